"""The CLI's lean client: the calls ``dsec exec``, ``run``, ``cp``, ``ls`` and ``rm`` make,
over blocking sockets, with plain dicts.

Why a second client: a CLI process lives for one command, and the SDK's import alone
(pydantic models, httpx, asyncio) costs ~0.25 s of CPU, which agent harnesses that shell
out per step pay every step. This module imports the standard library, httptools (the C
HTTP parser) and ``dsec.errors``, nothing else; it speaks the wire of docs/API.md, and
the servers validate what it sends (their ``invalid_spec`` errors name the field). Error
bodies become the SDK's typed errors through the one table in ``dsec.errors``.

``https://`` URLs, and URLs that the environment sends through a proxy, go through httpx
(imported then), as the SDK's calls do. Never used by the SDK; never imports pydantic,
rich or asyncio.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode, urlsplit

from dsec.errors import AuthError, DsecError, SandboxNotFound, decode_error, error_from_wire
from dsec.http import ENDED_HEADER

CONNECT_TIMEOUT_S = 10.0
TIMEOUT_S = 60.0
_PATH_SAFE = "/:@!$&'()*+,;=%~"


class Answer:
    """A whole answer: status, lower-cased headers, body."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes, url: str) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.url = url

    def json(self) -> Any:
        return json.loads(self.body)


if TYPE_CHECKING:  # (typing.Protocol classes cost ~1 ms each to create: only for the checker)
    from typing import Protocol

    class Streamed(Protocol):
        status: int
        url: str

        def chunks(self) -> Iterator[bytes]: ...
        def read(self) -> bytes: ...
        def close(self) -> None: ...

    class Transport(Protocol):
        def request(self, method: str, target: str, headers: Mapping[str, str], body: bytes | None,
                    timeout: float | None) -> Answer: ...
        def stream(self, method: str, target: str, headers: Mapping[str, str], body: bytes | None,
                   timeout: float | None) -> Streamed: ...
        def close(self) -> None: ...


class _Parse:
    """httptools callbacks collecting one answer; body pieces queue up for the reader."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.head_done = False
        self.done = False
        self.keep_alive = False
        self.parser: Any = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.head_done = True
        self.keep_alive = bool(self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        self.body.append(bytes(body))

    def on_message_complete(self) -> None:
        self.done = True


class _SocketStream:
    """The answer of one request on a socket, read as it comes."""

    def __init__(self, owner: SocketTransport, sock: socket.socket, url: str) -> None:
        import httptools

        self._owner = owner
        self._sock: socket.socket | None = sock
        self.url = url
        self._p = _Parse()
        self._p.parser = httptools.HttpResponseParser(self._p)
        self._got_any = False
        while not self._p.head_done:
            self._feed()
        self.status = int(self._p.parser.get_status_code())
        self.headers = self._p.headers

    def _feed(self) -> None:
        import httptools

        assert self._sock is not None
        try:
            data = self._sock.recv(1 << 18)
        except TimeoutError:
            self.close()
            raise DsecError(f"{self.url}: no answer in time") from None
        except OSError as exc:
            self.close()
            raise _Stale() if not self._got_any else DsecError(f"{self.url}: {exc.strerror or exc}") from None
        if not data:
            self.close()
            if not self._got_any:
                raise _Stale()
            if not self._p.done:
                raise DsecError(f"{self.url}: the server closed the connection mid-answer")
            return
        self._got_any = True
        try:
            self._p.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.close()
            raise DsecError(f"{self.url}: bad answer ({exc})") from None

    def chunks(self) -> Iterator[bytes]:
        while True:
            while self._p.body:
                yield self._p.body.pop(0)
            if self._p.done or self._sock is None:
                break
            self._feed()
        self._finish()

    def read(self) -> bytes:
        return b"".join(self.chunks())

    def _finish(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            if self._p.done and self._p.keep_alive:
                self._owner._idle = sock
            else:
                sock.close()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class _Stale(Exception):
    """A kept-alive connection closed before any answer byte."""


class SocketTransport:
    """Plain HTTP/1.1 to one ``host:port`` over blocking sockets, one kept-alive connection."""

    def __init__(self, base: str, what: str) -> None:
        u = urlsplit(base)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self.base = base.rstrip("/")
        self.what = what
        self._idle: socket.socket | None = None
        self._host_header = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            reason = (exc.strerror or type(exc).__name__).lower()
            raise DsecError(self.what.format(url=self.base, reason=reason)) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def stream(self, method: str, target: str, headers: Mapping[str, str], body: bytes | None,
               timeout: float | None) -> _SocketStream:
        lines = [f"{method} {self.prefix}{target} HTTP/1.1", f"Host: {self._host_header}",
                 *(f"{k}: {v}" for k, v in headers.items())]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        url = self.base + target
        reuse, self._idle = self._idle, None
        # A kept-alive connection the server has just closed fails before any answer byte:
        # try again on a fresh one, but only a request that is safe to repeat.
        for sock in ([reuse] if reuse is not None and method in ("GET", "HEAD", "PUT", "DELETE") else []) + [None]:
            if sock is None:
                if reuse is not None and method not in ("GET", "HEAD", "PUT", "DELETE"):
                    reuse.close()
                sock = self._connect()
            sock.settimeout(timeout)
            try:
                sock.sendall(head + body if body and len(body) < 65536 else head)
                if body and len(body) >= 65536:
                    sock.sendall(body)
                return _SocketStream(self, sock, url)
            except _Stale:
                if sock is not reuse:
                    raise DsecError(f"{url}: the server closed the connection without answering") from None
            except OSError as exc:
                sock.close()
                if sock is not reuse:
                    raise DsecError(f"{url}: {exc.strerror or exc}") from None
        raise AssertionError("unreachable")

    def request(self, method: str, target: str, headers: Mapping[str, str], body: bytes | None,
                timeout: float | None) -> Answer:
        s = self.stream(method, target, headers, body, timeout)
        data = s.read()
        return Answer(s.status, s.headers, data, s.url)

    def close(self) -> None:
        sock, self._idle = self._idle, None
        if sock is not None:
            sock.close()


class HttpxTransport:
    """The same calls through httpx: ``https://``, or a proxy from the environment."""

    def __init__(self, base: str, what: str) -> None:
        import httpx

        self.base = base.rstrip("/")
        self.what = what
        self._httpx = httpx
        self._client = httpx.Client(base_url=self.base, timeout=httpx.Timeout(TIMEOUT_S, connect=CONNECT_TIMEOUT_S))

    def stream(self, method: str, target: str, headers: Mapping[str, str], body: bytes | None,
               timeout: float | None) -> Streamed:
        httpx = self._httpx
        req = self._client.build_request(method, target, headers=dict(headers), content=body,
                                         timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S))
        try:
            resp = self._client.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise DsecError(self.what.format(url=self.base, reason=exc)) from None

        class _S:
            status = resp.status_code
            url = str(resp.url)

            def chunks(self) -> Iterator[bytes]:
                try:
                    yield from resp.iter_bytes()
                except httpx.HTTPError as exc:
                    raise DsecError(f"{resp.url}: {exc}") from None

            def read(self) -> bytes:
                return b"".join(self.chunks())

            def close(self) -> None:
                resp.close()

        return _S()

    def request(self, method: str, target: str, headers: Mapping[str, str], body: bytes | None,
                timeout: float | None) -> Answer:
        s = self.stream(method, target, headers, body, timeout)
        try:
            return Answer(s.status, {}, s.read(), s.url)
        finally:
            s.close()

    def close(self) -> None:
        self._client.close()


def _proxied(url: str) -> bool:
    names = ("http_proxy", "https_proxy", "all_proxy")
    if not any(os.environ.get(n) or os.environ.get(n.upper()) for n in names):
        return False
    from urllib.request import getproxies_environment, proxy_bypass_environment  # type: ignore[attr-defined]

    proxies = getproxies_environment()
    if not (proxies.get("http") or proxies.get("all")):
        return False
    return not proxy_bypass_environment(urlsplit(url).hostname or "", proxies)


def transport(base: str, what: str) -> Transport:
    if base.startswith("http://") and not _proxied(base):
        return SocketTransport(base, what)
    return HttpxTransport(base, what)


def raise_for(status: int, body: bytes, url: str, headers: dict[str, str] | None = None) -> None:
    """The typed error of an error answer (dsec.errors.decode_error: the one wire format)."""
    if status < 400:
        return
    payload: Any = body[:300].decode(errors="replace")
    with contextlib.suppress(ValueError):
        payload = json.loads(body)
    raise decode_error(status, payload, headers, where=url)


class Endpoint:
    """Calls to one server (the control plane or an edge) with its bearer token."""

    def __init__(self, base: str, token: str, what: str) -> None:
        self.base = base.rstrip("/")
        self.token = token
        self._t = transport(self.base, what)

    def _target(self, path: str, params: Mapping[str, Any] | list[tuple[str, str]] | None) -> str:
        target = quote(path, safe=_PATH_SAFE)
        if params:
            target += "?" + urlencode(params, doseq=True)
        return target

    def _headers(self, body: bytes | None, content_type: str | None) -> dict[str, str]:
        h = {"authorization": f"Bearer {self.token}", "accept": "application/json"}
        if content_type:
            h["content-type"] = content_type
        elif body is not None:
            h["content-type"] = "application/json"
        return h

    def call(self, method: str, path: str, *, params: Mapping[str, Any] | list[tuple[str, str]] | None = None,
             body: bytes | None = None, content_type: str | None = None, timeout: float | None = TIMEOUT_S) -> Answer:
        if body is None and method in ("POST", "PUT"):
            body = b""
        ans = self._t.request(method, self._target(path, params), self._headers(body, content_type), body, timeout)
        raise_for(ans.status, ans.body, ans.url, ans.headers)
        return ans

    def open(self, method: str, path: str, *, body: bytes | None = None, timeout: float | None = None) -> Streamed:
        s = self._t.stream(method, self._target(path, None), self._headers(body, None), body, timeout)
        if s.status >= 400:
            data = s.read()
            s.close()
            raise_for(s.status, data, s.url)
        return s

    def close(self) -> None:
        self._t.close()


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class LeanClient:
    """What the CLI's lean commands need of a DSec control plane (dicts in, dicts out)."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/")
        self.cp = Endpoint(self.url, token, "cannot reach the DSec control plane at {url} (DSEC_URL): {reason}; "
                                          "is `dsec up` running?")

    def __enter__(self) -> LeanClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.cp.close()

    def info(self, sandbox_id: str) -> dict[str, Any]:
        info: dict[str, Any] = self.cp.call("GET", f"/v1/sandboxes/{sandbox_id}").json()
        return info

    def connect(self, sandbox_id: str) -> LeanSandbox:
        """A running sandbox; one that ended raises SandboxNotFound saying why (as the SDK's connect)."""
        info = self.info(sandbox_id)
        if info.get("state") == "stopped" or not info.get("token"):
            raise SandboxNotFound.ended(sandbox_id, str(info.get("state")), str(info.get("reason") or ""))
        return LeanSandbox(self, info)

    def create(self, spec: Mapping[str, Any], *, labels: Mapping[str, str] | None = None, task: str | None = None,
               ttl_s: float = 3600.0) -> LeanSandbox:
        body = {"spec": spec, "labels": dict(labels or {}), "task": task, "lifecycle": {"ttl_s": ttl_s},
                "request_id": os.urandom(16).hex()}
        return LeanSandbox(self, self.cp.call("POST", "/v1/sandboxes", body=_json(body), timeout=300.0).json())

    def list(self, *, labels: Mapping[str, str] | None = None, task: str | None = None,
             state: str | None = None) -> list[dict[str, Any]]:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        if task:
            params.append(("task", task))
        if state:
            params.append(("state", state))
        data = self.cp.call("GET", "/v1/sandboxes", params=params).json()
        items: list[dict[str, Any]] = data["items"] if isinstance(data, dict) else data
        return items

    def delete(self, sandbox_id: str) -> None:
        """Delete a sandbox; deleting one that is gone is fine (as the SDK's)."""
        with contextlib.suppress(SandboxNotFound):
            self.cp.call("DELETE", f"/v1/sandboxes/{sandbox_id}")

    def remove(self, sandbox_id: str) -> str | None:
        """Delete a sandbox that exists (``dsec rm``): None when this call stopped it, how it
        had ended (``stopped (expired)``) when it had ended before; an unknown id raises
        SandboxNotFound."""
        ans = self.cp.call("DELETE", f"/v1/sandboxes/{sandbox_id}")
        return ans.headers.get(ENDED_HEADER) or None

    def delete_where(self, *, labels: Mapping[str, str] | None = None, task: str | None = None) -> int:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        if task:
            params.append(("task", task))
        return int(self.cp.call("DELETE", "/v1/sandboxes", params=params).json().get("deleted", 0))


class LeanSandbox:
    """One sandbox: exec and file calls go to its edge with its own token."""

    def __init__(self, client: LeanClient, info: dict[str, Any]) -> None:
        self._client = client
        self.info = info
        self.id: str = info["id"]
        self._edge: Endpoint | None = None
        self.files = LeanFiles(self)

    def edge(self) -> Endpoint:
        if self._edge is None:
            self._edge = Endpoint(self.info["edge_url"], self.info.get("token") or "",
                                  f"cannot reach edge {self.info.get('edge_id', '?')} at {{url}}: {{reason}}")
        return self._edge

    def call(self, method: str, path: str, **kw: Any) -> Answer:
        try:
            return self.edge().call(method, f"/v1/sandboxes/{self.id}{path}", **kw)
        except AuthError:
            self._refresh()  # an expired data-path token: a fresh one, once
            return self.edge().call(method, f"/v1/sandboxes/{self.id}{path}", **kw)

    def _refresh(self) -> None:
        self.info = self._client.connect(self.id).info
        if self._edge is not None:
            self._edge.close()
            self._edge = None

    def exec_stream(self, cmd: list[str] | str, *, timeout: float | None = 600.0, pristine: list[str] | None = None,
                    output_cap: int | None = None, env: Mapping[str, str] | None = None,
                    cwd: str = "/", stdin: bytes | None = None) -> Iterator[tuple[str, bytes, int] | dict[str, Any]]:
        """``(stream, data, dropped)`` as output is produced, then the result (ExecResultWire as a dict).
        An error line raises its typed error."""
        req: dict[str, Any] = {"cmd": cmd, "timeout": timeout, "cwd": cwd}
        if stdin:
            req["stdin_b64"] = base64.b64encode(stdin).decode()
        if env:
            req["env"] = dict(env)
        if pristine:
            req["pristine"] = list(pristine)
        if output_cap is not None:
            req["output_cap"] = output_cap
        http_timeout = None if timeout is None else timeout + 30.0
        try:
            s = self.edge().open("POST", f"/v1/sandboxes/{self.id}/exec/stream", body=_json(req), timeout=http_timeout)
        except AuthError:
            self._refresh()
            s = self.edge().open("POST", f"/v1/sandboxes/{self.id}/exec/stream", body=_json(req), timeout=http_timeout)
        try:
            pending = b""
            for piece in s.chunks():
                pending += piece
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield from _chunk(json.loads(line))
            if pending.strip():
                yield from _chunk(json.loads(pending))
        finally:
            s.close()

    def close(self) -> None:
        self._client.delete(self.id)
        if self._edge is not None:
            self._edge.close()


def _chunk(c: dict[str, Any]) -> Iterator[tuple[str, bytes, int] | dict[str, Any]]:
    kind = c.get("kind")
    if kind in ("stdout", "stderr"):
        yield kind, base64.b64decode(c.get("data_b64") or ""), int(c.get("dropped_bytes") or 0)
    elif kind == "result":
        yield dict(c["result"])
    elif kind == "error":
        raise error_from_wire(dict(c.get("error") or {}))


class LeanFiles:
    """Files of one sandbox (paths absolute, inside the sandbox)."""

    def __init__(self, sb: LeanSandbox) -> None:
        self._sb = sb

    def stat(self, path: str) -> dict[str, Any]:
        st: dict[str, Any] = self._sb.call("GET", "/files/stat", params={"path": path}).json()
        return st

    def read(self, path: str) -> bytes:
        return self._sb.call("GET", "/files", params={"path": path}, timeout=None).body

    def write(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        self._sb.call("PUT", "/files", params={"path": path, "mode": oct(mode)[2:]}, body=data,
                      content_type="application/octet-stream", timeout=None)

    def upload(self, path: str, tar: bytes) -> int:
        """Extract a tar into directory ``path`` (made if missing); the entries written."""
        ans = self._sb.call("PUT", "/files/tar", params={"path": path}, body=tar, content_type="application/x-tar",
                            timeout=None)
        return int(ans.json().get("entries", 0))

    def download(self, path: str) -> bytes:
        """A tar of directory ``path``: its entries, relative to it."""
        return self._sb.call("GET", "/files/tar", params={"path": path}, timeout=None).body


def lean_client(url: str | None = None, token: str | None = None) -> LeanClient:
    """A client from $DSEC_URL / $DSEC_TOKEN (or the local all-in-one's admin token)."""
    from dsec.cli.paths import DEFAULT_URL, local_token

    tok = token or local_token()
    if not tok:
        raise AuthError("no API token: set DSEC_TOKEN (`dsec token create` makes one), or run as a user who can "
                        "read the local `dsec up`'s admin token")
    return LeanClient(url or os.environ.get("DSEC_URL") or DEFAULT_URL, tok)
