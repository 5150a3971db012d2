"""Running a real OCI registry on this machine: Debian's ``docker-registry`` (CNCF distribution 2.8).

Owns: :class:`RegistryServer`, one ``docker-registry serve`` process on a
loopback address with its own root directory and config (a throwaway temporary
directory by default, or a directory that outlives it, as ``dsec up --registry``
keeps under its data directory), with optional htpasswd basic auth or
bearer-token auth; and :class:`TokenServer`, a small real token server of the
distribution bearer-token flow (the registry answers ``401`` with
``WWW-Authenticate: Bearer realm=...,service=...,scope=...``; the client gets a
JWT from the realm and retries with it). The token server signs RS256 JWTs
with a throwaway RSA key made by ``openssl``, whose certificate the registry
trusts.

Never binds anything but the address it is given (loopback by default), and
never leaves a process behind: :meth:`RegistryServer.stop` terminates (then
kills) the registry, and the registry is told to die with the thread that
started it (``PR_SET_PDEATHSIG``) should that process die first.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from dsec.errors import HostError

from .errors import RegistryError
from .fsutil import remove_tree

_LISTENING = re.compile(r"listening on \[?([0-9A-Za-z.:]*?)\]?:(\d+)")
_BCRYPT_ALPHABET = "./ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_PR_SET_PDEATHSIG = 1


def registry_binary() -> str:
    for name in ("docker-registry", "registry"):
        path = shutil.which(name)
        if path is not None:
            return path
    raise HostError("docker-registry not found: install it (apt-get install docker-registry)",
                    binary="docker-registry")  # fmt: skip


def bcrypt_hash(password: str, *, cost: int = 5) -> str:
    """A ``$2b$`` bcrypt hash (what distribution's htpasswd auth reads), made by the
    system's libcrypt. Cost 5 keeps each authenticated request around a millisecond."""
    name = ctypes.util.find_library("crypt") or "libcrypt.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        raise HostError(f"libcrypt is missing ({e}); it makes htpasswd entries", binary=name) from e
    lib.crypt.restype = ctypes.c_char_p
    lib.crypt.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    salt = f"$2b${cost:02d}$" + "".join(secrets.choice(_BCRYPT_ALPHABET) for _ in range(22))
    out = lib.crypt(password.encode(), salt.encode())
    if not out or not out.startswith(b"$2b$"):
        raise HostError("this libcrypt cannot make bcrypt hashes", binary=name)
    return str(out.decode())


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


# -- the token server ------------------------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def libtrust_key_id(der_public_key: bytes) -> str:
    """distribution's key id for a public key (libtrust): base32 of the first 240 bits of
    the sha256 of its DER SubjectPublicKeyInfo, in colon-separated groups of four."""
    b32 = base64.b32encode(hashlib.sha256(der_public_key).digest()[:30]).decode().rstrip("=")
    return ":".join(b32[i : i + 4] for i in range(0, len(b32), 4))


def _openssl() -> str:
    path = shutil.which("openssl")
    if path is None:
        raise HostError("openssl not found: install it (apt-get install openssl)", binary="openssl")
    return path


Grant = Callable[[str | None, str, str, list[str]], list[str]]
"""``grant(user, type, name, actions) -> allowed actions``; ``user`` None is anonymous."""


def default_grant(anonymous_pull: bool) -> Grant:
    def grant(user: str | None, type_: str, name: str, actions: list[str]) -> list[str]:
        if user is not None:
            return actions
        return [a for a in actions if a == "pull"] if anonymous_pull else []

    return grant


@dataclass
class TokenServer:
    """The distribution bearer-token flow's token server, on loopback, in a thread.

    ``GET /token?service=S&scope=repository:NAME:ACTIONS...`` with optional basic
    auth answers ``{"token", "access_token", "expires_in", "issued_at"}``: an
    RS256 JWT whose ``access`` lists what ``grant`` allows. Wrong credentials get
    401; no credentials get a token with the anonymous grant. ``requests`` counts
    the tokens issued (tests check that clients cache them).
    """

    users: dict[str, str] = field(default_factory=dict)
    anonymous_pull: bool = False
    grant: Grant | None = None
    service: str = "dsec-registry"
    issuer: str = "dsec-token-server"
    ttl_s: int = 300
    host: str = "127.0.0.1"
    requests: int = 0
    scopes_seen: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._dir: Path | None = None
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.kid = ""

    @property
    def cert_path(self) -> Path:
        assert self._dir is not None, "start the token server first"
        return self._dir / "cert.pem"

    @property
    def realm(self) -> str:
        assert self._httpd is not None, "start the token server first"
        return f"http://{self.host}:{self._httpd.server_port}/token"

    def start(self) -> TokenServer:
        if self._httpd is not None:
            return self
        self._dir = Path(tempfile.mkdtemp(prefix="dsec-token-"))
        openssl = _openssl()
        key, cert = self._dir / "key.pem", self._dir / "cert.pem"
        proc = subprocess.run(
            [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
             "-days", "2", "-subj", "/CN=dsec-token-server"],
            capture_output=True, text=True, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if proc.returncode != 0:
            raise HostError(f"openssl could not make the token server's key: {proc.stderr.strip()[-500:]}",
                            binary="openssl")  # fmt: skip
        pub = subprocess.run([openssl, "x509", "-in", str(cert), "-pubkey", "-noout"], capture_output=True,
                             check=True).stdout  # fmt: skip
        der = subprocess.run([openssl, "pkey", "-pubin", "-outform", "DER"], input=pub, capture_output=True,
                             check=True).stdout  # fmt: skip
        self.kid = libtrust_key_id(der)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                server._handle(self)

        self._httpd = ThreadingHTTPServer((self.host, 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="dsec-token-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> TokenServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _user(self, header: str | None) -> tuple[bool, str | None]:
        """(credentials acceptable, user name or None for anonymous)."""
        if not header:
            return True, None
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic":
            return False, None
        try:
            user, _, password = base64.b64decode(value).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False, None
        ok = user in self.users and secrets.compare_digest(self.users[user], password)
        return ok, user if ok else None

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(h.path)
        if url.path != "/token":
            h.send_error(404)
            return
        q = urllib.parse.parse_qs(url.query)
        ok, user = self._user(h.headers.get("Authorization"))
        if not ok:
            body = json.dumps({"errors": [{"code": "UNAUTHORIZED", "message": "bad credentials"}]}).encode()
            h.send_response(401)
            h.send_header("Content-Type", "application/json")
            h.send_header("WWW-Authenticate", 'Basic realm="dsec-token-server"')
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            return
        grant = self.grant or default_grant(self.anonymous_pull)
        access = []
        for scope in q.get("scope", []):
            for one in scope.split():
                parts = one.split(":")
                if len(parts) < 3:
                    continue
                type_, name, actions = parts[0], ":".join(parts[1:-1]), parts[-1].split(",")
                allowed = grant(user, type_, name, [a for a in actions if a])
                access.append({"type": type_, "name": name, "actions": allowed})
        token = self._sign(user or "", q.get("service", [self.service])[0], access)
        with self._lock:
            self.requests += 1
            self.scopes_seen.extend(q.get("scope", []))
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        body = json.dumps({"token": token, "access_token": token, "expires_in": self.ttl_s,
                           "issued_at": now}).encode()  # fmt: skip
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _sign(self, subject: str, audience: str, access: list[dict[str, Any]]) -> str:
        assert self._dir is not None
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "kid": self.kid}
        claims = {"iss": self.issuer, "sub": subject, "aud": audience, "exp": now + self.ttl_s,
                  "nbf": now - 10, "iat": now, "jti": secrets.token_hex(16), "access": access}  # fmt: skip
        signing_input = (_b64url(json.dumps(header, separators=(",", ":")).encode()) + "."
                         + _b64url(json.dumps(claims, separators=(",", ":")).encode()))  # fmt: skip
        sig = subprocess.run([_openssl(), "dgst", "-sha256", "-sign", str(self._dir / "key.pem")],
                             input=signing_input.encode(), capture_output=True, check=True).stdout  # fmt: skip
        return signing_input + "." + _b64url(sig)


# -- the registry -------------------------------------------------------------------------------


class RegistryServer:
    """One ``docker-registry`` on ``host`` (loopback), ready when :meth:`start` returns.

    ``root`` holds ``config.yml``, ``registry.log`` and ``data/`` (the blobs); None
    makes a temporary one that :meth:`stop` deletes. ``port`` 0 lets the kernel
    choose (read :attr:`url` after start). Auth: ``htpasswd`` (user -> password,
    basic auth) or ``token`` (a started :class:`TokenServer`), not both.
    """

    def __init__(
        self,
        root: Path | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        htpasswd: dict[str, str] | None = None,
        token: TokenServer | None = None,
        die_with_parent: bool = True,
        start_timeout: float = 20.0,
        netns: str | None = None,
    ) -> None:
        if htpasswd is not None and token is not None:
            raise ValueError("give htpasswd or token auth, not both")
        self._throwaway = root is None
        # A throwaway root is made by start(), so an instance never started leaves nothing.
        self.root = Path(root) if root is not None else Path()
        self.host = host
        self.port = port
        self.htpasswd = htpasswd
        self.token = token
        self.die_with_parent = die_with_parent
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.netns = netns
        """Run inside this named network namespace (``ip netns exec``): a registry on another "host"."""
        self.url = ""

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "registry.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def blob_file(self, digest: str) -> Path:
        """Where the filesystem driver keeps a blob's bytes (tests damage it here)."""
        hexd = digest.split(":", 1)[1]
        return self.data_dir / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def _config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "version": "0.1",
            "log": {"level": "info", "formatter": "text", "accesslog": {"disabled": True}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.data_dir)},
                "delete": {"enabled": True},
                "maintenance": {"uploadpurging": {"enabled": False}},
            },
            "http": {
                "addr": f"{'[' + self.host + ']' if ':' in self.host else self.host}:{self.port}",
                "secret": secrets.token_hex(16),
                "headers": {"X-Content-Type-Options": ["nosniff"]},
            },
        }
        if self.htpasswd is not None:
            path = self.root / "htpasswd"
            path.write_text("".join(f"{u}:{bcrypt_hash(p)}\n" for u, p in self.htpasswd.items()))
            os.chmod(path, 0o600)
            cfg["auth"] = {"htpasswd": {"realm": "dsec-registry", "path": str(path)}}
        elif self.token is not None:
            cfg["auth"] = {"token": {"realm": self.token.realm, "service": self.token.service,
                                     "issuer": self.token.issuer,
                                     "rootcertbundle": str(self.token.cert_path)}}  # fmt: skip
        return cfg

    def start(self) -> RegistryServer:
        if self.proc is not None:
            return self
        binary = registry_binary()
        if self._throwaway:
            self.root = Path(tempfile.mkdtemp(prefix="dsec-registry-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(exist_ok=True)
        config = self.root / "config.yml"
        # YAML is a superset of JSON: no YAML writer needed.
        config.write_text(json.dumps(self._config(), indent=1))
        os.chmod(config, 0o600)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        start_at = self.log_path.stat().st_size
        try:
            self.proc = subprocess.Popen(
                [*(["ip", "netns", "exec", self.netns] if self.netns else []), binary, "serve", str(config)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
                cwd=self.root,
            )  # fmt: skip
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout
        while True:
            text = self._log_since(start_at)
            m = _LISTENING.search(text)
            if m is not None:
                host = m.group(1) or self.host
                self.url = f"http://{'[' + host + ']' if ':' in host else host}:{m.group(2)}"
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                code = self.proc.poll()
                self.stop()
                why = f"exited with {code}" if code is not None else f"did not listen within {self.start_timeout:.0f} s"
                raise RegistryError(f"docker-registry {why}:\n{text[-2000:]}", status=0, registry_code="",
                                    url="")  # fmt: skip
            time.sleep(0.02)

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the registry (SIGTERM, then SIGKILL after 5 s); delete a throwaway root."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self._throwaway and self.root != Path():
            with contextlib.suppress(OSError):
                remove_tree(self.root)
            self.root = Path()

    def __enter__(self) -> RegistryServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_for_data_dir(data_dir: Path, *, host: str = "127.0.0.1", port: int = 0) -> RegistryServer:
    """The registry of an all-in-one (``dsec up --registry``): root ``<data_dir>/registry``
    (kept: pushed layers outlive restarts), anonymous, on ``host:port``. Its URL is also
    written to ``<data_dir>/registry/url`` for tools that look for it."""
    reg = RegistryServer(Path(data_dir) / "registry", host=host, port=port).start()
    try:
        (reg.root / "url").write_text(reg.url + "\n")
    except OSError:
        reg.stop()
        raise
    return reg


__all__ = [
    "RegistryServer",
    "TokenServer",
    "bcrypt_hash",
    "libtrust_key_id",
    "registry_binary",
    "start_for_data_dir",
]
