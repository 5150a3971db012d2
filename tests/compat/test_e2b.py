"""E2B's released clients (``e2b``, ``e2b-code-interpreter``) unchanged against DSec.

One ``dsec up`` (a subprocess, real sandboxes) and the four variables ``dsec env e2b``
prints; every call below is the released client's own. docs/COMPAT.md, "E2B".
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2b_up import TINY, e2b_test_up

pytestmark = [pytest.mark.root, pytest.mark.timeout(900)]

E2B_VARS = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")


@pytest.fixture(scope="module")
def up() -> Iterator[dict[str, str]]:
    with e2b_test_up() as env, pytest.MonkeyPatch.context() as mp:
        for k in E2B_VARS:
            mp.setenv(k, env[k])
        yield env


@pytest.fixture
def sandbox(up: dict[str, str]) -> Iterator[object]:
    from e2b import Sandbox

    sb = Sandbox.create(envs={"SANDBOX_VAR": "from-create"})
    try:
        yield sb
    finally:
        sb.kill()


# ------------------------------------------------------------ lifecycle ----


def test_lifecycle_create_info_list_paging_timeout_kill(up: dict[str, str]) -> None:
    from e2b import Sandbox, SandboxQuery
    from e2b.exceptions import NotFoundException

    run = uuid.uuid4().hex[:12]
    a = Sandbox.create(metadata={"run": run, "who": "a"}, envs={"GREETING": "hi"}, timeout=120)
    b = Sandbox.create(metadata={"run": run, "who": "b", "Odd Key": "x y"})
    try:
        info = a.get_info()
        assert info.sandbox_id == a.sandbox_id and info.template_id == "base"
        assert info.metadata == {"run": run, "who": "a"}
        assert info.state.value == "running" and info.envd_version
        assert 100 <= (info.end_at - info.started_at).total_seconds() <= 125
        assert b.get_info().metadata["Odd Key"] == "x y"
        # envVars of the create reach every command
        assert a.commands.run("echo $GREETING").stdout == "hi\n"

        seen: list[str] = []
        pager = Sandbox.list(query=SandboxQuery(metadata={"run": run}), limit=1)
        while pager.has_next:
            page = pager.next_items()
            assert len(page) <= 1
            seen += [s.sandbox_id for s in page]
        assert sorted(seen) == sorted([a.sandbox_id, b.sandbox_id])
        only_b = Sandbox.list(query=SandboxQuery(metadata={"run": run, "who": "b"})).next_items()
        assert [s.sandbox_id for s in only_b] == [b.sandbox_id]

        a.set_timeout(60)
        assert (a.get_info().end_at - a.get_info().started_at).total_seconds() < 100
        assert a.is_running()
    finally:
        assert a.kill() is True
        b.kill()
    with pytest.raises(NotFoundException):
        Sandbox.get_info(a.sandbox_id)
    assert Sandbox.kill(a.sandbox_id) is False
    assert not a.is_running()


def test_an_unknown_template_and_a_bad_key_are_refused(up: dict[str, str]) -> None:
    from e2b import Sandbox
    from e2b.exceptions import AuthenticationException, SandboxException

    with pytest.raises(SandboxException, match="not found"):
        Sandbox.create(template="no-such-template")
    with pytest.raises(SandboxException, match=r"400: .*no-such-image:1.*cannot be had"):  # slime's image key
        Sandbox.create(metadata={"image": "no-such-image:1"})
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_" + "00" * 20)
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="not-an-e2b-key")


def test_an_idempotency_key_makes_one_sandbox(up: dict[str, str]) -> None:
    from e2b import Sandbox

    key = uuid.uuid4().hex
    hdr = {"X-API-KEY": up["E2B_API_KEY"], "Idempotency-Key": key}
    first = httpx.post(up["E2B_API_URL"] + "/v2/sandboxes", json={"templateID": "base"}, headers=hdr, timeout=60)
    again = httpx.post(up["E2B_API_URL"] + "/v2/sandboxes", json={"templateID": "base"}, headers=hdr, timeout=60)
    try:
        assert first.status_code == 201 and again.status_code == 201, (first.text, again.text)
        assert first.json()["sandboxID"] == again.json()["sandboxID"]
        other = httpx.post(up["E2B_API_URL"] + "/v2/sandboxes", json={"templateID": "base"},
                           headers={**hdr, "Idempotency-Key": key + "x"}, timeout=60)
        assert other.status_code == 201 and other.json()["sandboxID"] != first.json()["sandboxID"]
        assert Sandbox.kill(other.json()["sandboxID"]) is True
    finally:
        Sandbox.kill(first.json()["sandboxID"])


# ------------------------------------------------------------ commands ----


def test_commands_output_exit_codes_cwd_envs_users(sandbox: object) -> None:
    from e2b.sandbox.commands.command_handle import CommandExitException

    sb = sandbox
    r = sb.commands.run("echo out; echo err >&2; exit 0")  # type: ignore[attr-defined]
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
    with pytest.raises(CommandExitException) as exc:
        sb.commands.run("echo partial; exit 7")  # type: ignore[attr-defined]
    assert exc.value.exit_code == 7 and exc.value.stdout == "partial\n"
    assert sb.commands.run("pwd; whoami; echo $HOME").stdout == "/home/user\nuser\n/home/user\n"  # type: ignore[attr-defined]
    assert sb.commands.run("pwd; whoami", cwd="/tmp", user="root").stdout == "/tmp\nroot\n"  # type: ignore[attr-defined]
    r = sb.commands.run("echo $A-$SANDBOX_VAR", envs={"A": "1"})  # type: ignore[attr-defined]
    assert r.stdout == "1-from-create\n"


def test_commands_timeout_streaming_background_stdin_connect_list(sandbox: object) -> None:
    from e2b.exceptions import TimeoutException
    from e2b.sandbox.commands.command_handle import CommandExitException

    sb = sandbox
    with pytest.raises(TimeoutException):
        sb.commands.run("sleep 30", timeout=1)  # type: ignore[attr-defined]

    chunks: list[str] = []
    sb.commands.run("for i in 1 2 3; do echo line$i; sleep 0.3; done", on_stdout=chunks.append)  # type: ignore[attr-defined]
    assert "".join(chunks) == "line1\nline2\nline3\n" and len(chunks) == 3  # one chunk as each line came

    bg = sb.commands.run("sleep 600", background=True)  # type: ignore[attr-defined]
    assert bg.pid in [p.pid for p in sb.commands.list()]  # type: ignore[attr-defined]
    assert sb.commands.kill(bg.pid) is True  # type: ignore[attr-defined]
    with pytest.raises(CommandExitException):
        bg.wait()
    assert sb.commands.kill(bg.pid) is False  # type: ignore[attr-defined]

    cat = sb.commands.run("cat", background=True, stdin=True)  # type: ignore[attr-defined]
    again = sb.commands.connect(cat.pid)  # type: ignore[attr-defined]  # sees what comes after it (as envd)
    sb.commands.send_stdin(cat.pid, "to stdin\n")  # type: ignore[attr-defined]
    sb.commands.close_stdin(cat.pid)  # type: ignore[attr-defined]
    assert again.wait().stdout == "to stdin\n"
    assert cat.wait().stdout == "to stdin\n"


def test_pty_input_resize_kill(sandbox: object) -> None:
    from e2b.sandbox.commands.command_handle import PtySize

    sb = sandbox
    out = bytearray()
    got = threading.Event()

    def on_pty(data: bytes) -> None:
        out.extend(data)
        if b"size=40 100" in out:
            got.set()

    term = sb.pty.create(PtySize(rows=30, cols=90))  # type: ignore[attr-defined]
    waiter = threading.Thread(target=_wait_quiet, args=(term, on_pty), daemon=True)
    waiter.start()
    sb.pty.resize(term.pid, PtySize(rows=40, cols=100))  # type: ignore[attr-defined]
    sb.pty.send_stdin(term.pid, b"echo size=$(stty size)\n")  # type: ignore[attr-defined]
    assert got.wait(30), bytes(out)
    assert sb.pty.kill(term.pid) is True  # type: ignore[attr-defined]
    waiter.join(30)
    assert not waiter.is_alive()


def _wait_quiet(handle: object, on_pty: object) -> None:
    with contextlib.suppress(Exception):  # killed: CommandExitException
        handle.wait(on_pty=on_pty)  # type: ignore[attr-defined]


# ------------------------------------------------------------ files ----


def test_files_write_read_list_exists_mkdir_rename_remove_url(sandbox: object) -> None:
    sb = sandbox
    blob = bytes(range(256)) * 4096  # 1 MiB, every byte value
    sb.files.write("/home/user/t.txt", "text ✓")  # type: ignore[attr-defined]
    sb.files.write("notes/b.bin", blob)  # type: ignore[attr-defined]  # relative: under the home
    sb.files.write("/tmp/obj.bin", io.BytesIO(b"from a file object"))  # type: ignore[attr-defined]  # octet-stream
    assert sb.files.read("/home/user/t.txt") == "text ✓"  # type: ignore[attr-defined]
    assert bytes(sb.files.read("/home/user/notes/b.bin", format="bytes")) == blob  # type: ignore[attr-defined]
    assert b"".join(sb.files.read("/tmp/obj.bin", format="stream")) == b"from a file object"  # type: ignore[attr-defined]
    assert sb.commands.run("stat -c %U /home/user/notes/b.bin").stdout == "user\n"  # type: ignore[attr-defined]

    names = {e.path for e in sb.files.list("/home/user", depth=2)}  # type: ignore[attr-defined]
    assert {"/home/user/t.txt", "/home/user/notes", "/home/user/notes/b.bin"} <= names
    assert {e.name for e in sb.files.list("/home/user")} >= {"t.txt", "notes"}  # type: ignore[attr-defined]
    assert sb.files.exists("/home/user/t.txt") and not sb.files.exists("/home/user/nope")  # type: ignore[attr-defined]
    assert sb.files.make_dir("/home/user/d/e") is True  # type: ignore[attr-defined]
    assert sb.files.make_dir("/home/user/d/e") is False  # type: ignore[attr-defined]
    moved = sb.files.rename("/home/user/t.txt", "/home/user/d/t2.txt")  # type: ignore[attr-defined]
    assert moved.path == "/home/user/d/t2.txt" and not sb.files.exists("/home/user/t.txt")  # type: ignore[attr-defined]
    sb.files.remove("/home/user/d")  # type: ignore[attr-defined]
    assert not sb.files.exists("/home/user/d/t2.txt")  # type: ignore[attr-defined]

    url = sb.download_url("/home/user/notes/b.bin")  # type: ignore[attr-defined]
    assert httpx.get(url, timeout=30).content == blob
    up_url = sb.upload_url("/home/user/up.txt")  # type: ignore[attr-defined]
    r = httpx.post(up_url, files={"file": ("up.txt", b"uploaded")}, timeout=30)
    assert r.status_code == 200, r.text
    assert sb.files.read("/home/user/up.txt") == "uploaded"  # type: ignore[attr-defined]


def test_an_upload_past_the_disk_quota_is_507_and_leaves_nothing(up: dict[str, str]) -> None:
    """A 48 MiB upload into a 32 MiB disk: NotEnoughSpaceException (HTTP 507, as the client maps
    it) for root and for `user`, in both upload forms; no partial file stays, the room is back."""
    from e2b import Sandbox
    from e2b.exceptions import NotEnoughSpaceException

    sb = Sandbox.create(template=TINY)
    try:
        big = os.urandom(48 << 20)  # incompressible
        for path, user, data in (("/root/big.bin", "root", big), ("/home/user/big.bin", "user", io.BytesIO(big))):
            with pytest.raises(NotEnoughSpaceException):
                sb.files.write(path, data, user=user)
            assert not sb.files.exists(path), path
        r = httpx.post(up["E2B_SANDBOX_URL"] + "/files", params={"path": "/tmp/raw.bin"}, content=big,
                       headers={"E2b-Sandbox-Id": sb.sandbox_id, "X-Access-Token": sb._envd_access_token,
                                "Content-Type": "application/octet-stream"}, timeout=60)
        assert r.status_code == 507 and r.json()["code"] == 507, r.text
        assert not sb.files.exists("/tmp/raw.bin")
        # past the room left (the body fits the disk, the write does not): ENOSPC -> 507 too
        sb.commands.run("head -c 20M /dev/urandom > /home/user/fill")
        for path, user in (("/root/mid.bin", "root"), ("/home/user/mid.bin", "user")):
            with pytest.raises(NotEnoughSpaceException):
                sb.files.write(path, big[: 20 << 20], user=user)
            assert not sb.files.exists(path), path
        sb.commands.run("rm /home/user/fill; sync")
        # the room is back: what failed left no data behind (the quota counts every byte)
        sb.files.write("/home/user/again.bin", big[: 20 << 20])
        used_kib = int(sb.commands.run("du -sk /home/user /root /tmp | awk '{s += $1} END {print s}'").stdout)
        assert 20 << 10 <= used_kib <= (20 << 10) + 256, used_kib
    finally:
        sb.kill()


def test_files_errors_are_typed(sandbox: object) -> None:
    from e2b.exceptions import NotFoundException

    sb = sandbox
    with pytest.raises(NotFoundException):
        sb.files.read("/home/user/missing.txt")  # type: ignore[attr-defined]
    with pytest.raises(NotFoundException):
        sb.files.list("/no/such/dir")  # type: ignore[attr-defined]


def test_watch_dir(sandbox: object) -> None:
    from e2b import FilesystemEventType

    sb = sandbox
    sb.files.make_dir("/home/user/w")  # type: ignore[attr-defined]
    watcher = sb.files.watch_dir("/home/user/w")  # type: ignore[attr-defined]
    sb.files.write("/home/user/w/new.txt", "x")  # type: ignore[attr-defined]
    events = []
    for _ in range(40):
        events += watcher.get_new_events()
        if any(e.type == FilesystemEventType.CREATE and e.name == "new.txt" for e in events):
            break
        threading.Event().wait(0.25)
    watcher.stop()
    assert any(e.type == FilesystemEventType.CREATE and e.name == "new.txt" for e in events), events


# ------------------------------------------------------------ access ----


def test_access_tokens_and_a_killed_sandbox_on_the_envd_plane(up: dict[str, str]) -> None:
    from e2b import Sandbox
    from e2b.exceptions import SandboxException

    a = Sandbox.create()
    b = Sandbox.create()
    try:
        url = up["E2B_SANDBOX_URL"] + "/process.Process/List"
        hdr = {"E2b-Sandbox-Id": a.sandbox_id, "E2b-Sandbox-Port": "49983", "Content-Type": "application/json"}
        # b's token does not open a
        r = httpx.post(url, json={}, headers={**hdr, "X-Access-Token": b._envd_access_token}, timeout=10)
        assert r.status_code in (401, 403), r.text
        r = httpx.post(url, json={}, headers=hdr, timeout=10)
        assert r.status_code == 401, r.text
        r = httpx.post(url, json={}, headers={**hdr, "X-Access-Token": a._envd_access_token}, timeout=10)
        assert r.status_code == 200 and r.json() == {}, r.text
    finally:
        a.kill()
        b.kill()
    with pytest.raises(SandboxException) as exc:
        a.commands.run("true")
    assert "not running" in str(exc.value) or "was not found" in str(exc.value), exc.value
    r = httpx.get(up["E2B_SANDBOX_URL"] + "/files", params={"path": "/etc/hostname"},
                  headers={"E2b-Sandbox-Id": a.sandbox_id, "X-Access-Token": a._envd_access_token}, timeout=10)
    assert r.status_code == 502 and "was not found" in r.json()["message"], r.text


def test_without_the_sandbox_url_the_client_fails_fast(up: dict[str, str]) -> None:
    """With E2B_SANDBOX_URL unset, envd traffic goes to <port>-<id>.dsec.invalid: no DNS, no request."""
    code = ("import os\nfrom e2b import Sandbox\n"
            "sb = Sandbox.create()\n"
            "try:\n    sb.commands.run('true', request_timeout=20)\n    print('REACHED')\n"
            "except Exception as e:\n    print('FAILED', type(e).__name__)\n"
            "finally:\n    sb.kill()\n")
    env = {**os.environ, **{k: up[k] for k in E2B_VARS}}
    env.pop("E2B_SANDBOX_URL")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "FAILED" in out.stdout and "REACHED" not in out.stdout, out.stdout + out.stderr


SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        if self.path == "/chunked":
            self.send_response(200); self.send_header("Transfer-Encoding", "chunked"); self.end_headers()
            for part in (b"one,", b"two,", b"three"):
                self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(part), part))
            self.wfile.write(b"0\\r\\n\\r\\n"); return
        body = ("path=%s host=%s who=%s" % (self.path, self.headers["Host"], self.headers.get("X-Who"))).encode()
        self.send_response(200); self.send_header("X-Served-By", "sandbox"); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def do_POST(self):
        if self.headers.get("Transfer-Encoding") == "chunked":
            data = b""
            while True:
                n = int(self.rfile.readline().strip(), 16)
                if n == 0:
                    self.rfile.readline(); break
                data += self.rfile.read(n); self.rfile.readline()
        else:
            data = self.rfile.read(int(self.headers["Content-Length"]))
        out = data.upper()
        self.send_response(201); self.send_header("Content-Length", str(len(out))); self.end_headers(); self.wfile.write(out)
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_users_own_server_through_the_front(up: dict[str, str], sandbox: object) -> None:
    """E2b-Sandbox-Port (or get_host's `<port>-<id>.` Host) reaches the user's server inside the
    sandbox: GET, POST with a length and chunked, a chunked answer; the traffic token is
    needed (and another sandbox's is refused); a port nothing listens on is 502."""
    import time

    sb = sandbox
    sb.files.write("/home/user/srv.py", SERVER)  # type: ignore[attr-defined]
    sb.commands.run("python3 /home/user/srv.py 8000", background=True)  # type: ignore[attr-defined]
    url = up["E2B_SANDBOX_URL"]
    tok = sb._envd_access_token  # type: ignore[attr-defined]
    hdr = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8000", "E2B-Traffic-Access-Token": tok}  # type: ignore[attr-defined]
    with httpx.Client(base_url=url, timeout=30) as h:
        deadline = time.monotonic() + 30
        while (r := h.get("/x?q=1", headers={**hdr, "X-Who": "me"})).status_code == 502:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)
        assert r.status_code == 200 and r.headers["x-served-by"] == "sandbox", r.text
        assert r.text.startswith("path=/x?q=1 host=127.0.0.1:") and r.text.endswith("who=me"), r.text
        host = sb.get_host(8000)  # type: ignore[attr-defined]
        assert host == f"8000-{sb.sandbox_id}.dsec.invalid"  # type: ignore[attr-defined]
        r = h.get("/via-host", headers={"Host": host, "X-Access-Token": tok})
        assert r.status_code == 200 and r.text.startswith(f"path=/via-host host={host}"), r.text
        r = h.post("/echo", headers=hdr, content=b"abc" * 100_000)
        assert r.status_code == 201 and r.content == b"ABC" * 100_000
        r = h.post("/echo", headers=hdr, content=iter([b"chunked ", b"body"]))
        assert r.status_code == 201 and r.content == b"CHUNKED BODY", r.text
        r = h.get("/chunked", headers=hdr)
        assert r.status_code == 200 and r.content == b"one,two,three"
        r = h.get("/", headers={**hdr, "E2b-Sandbox-Port": "8001"})
        assert r.status_code == 502 and "port 8001 is not open" in r.json()["message"], r.text
        r = h.get("/", headers={k: v for k, v in hdr.items() if k != "E2B-Traffic-Access-Token"})
        assert r.status_code == 401, r.text
    from e2b import Sandbox

    other = Sandbox.create()
    try:
        r = httpx.get(url + "/", headers={**hdr, "E2B-Traffic-Access-Token": other._envd_access_token}, timeout=30)
        assert r.status_code in (401, 403), r.text
    finally:
        other.kill()


# ------------------------------------------------------------ code interpreter ----


def test_run_code_state_errors_and_contexts(up: dict[str, str]) -> None:
    from e2b_code_interpreter import Sandbox as CodeSandbox

    sb = CodeSandbox.create()  # template code-interpreter-v1: the jupyter toolchain
    try:
        assert sb.run_code("x = 41").error is None
        ex = sb.run_code("print('hello'); x + 1")
        assert ex.text == "42" and ex.logs.stdout == ["hello\n"]
        err = sb.run_code("1 / 0")
        assert err.error is not None and err.error.name == "ZeroDivisionError" and "division by zero" in err.error.traceback
        ctx = sb.create_code_context()
        other = sb.run_code("'x' in dir()", context=ctx)
        assert other.text == "False"  # a fresh kernel: no x there
        assert ctx.id in [c.id for c in sb.list_code_contexts()]
        sb.remove_code_context(ctx)
        assert ctx.id not in [c.id for c in sb.list_code_contexts()]
        assert sb.run_code("x").text == "41"  # the default context kept its state
    finally:
        sb.kill()


# ------------------------------------------------------------ pause, reconnect ----


def test_pause_then_connect_from_another_process(up: dict[str, str]) -> None:
    from e2b import Sandbox

    sb = Sandbox.create(timeout=600)
    try:
        sb.files.write("/home/user/kept.txt", "still here")
        bg = sb.commands.run("sleep 900", background=True)
        assert sb.beta_pause() is True
        assert Sandbox.get_info(sb.sandbox_id).state.value == "paused"
        code = ("import sys\nfrom e2b import Sandbox\n"
                "sb = Sandbox.connect(sys.argv[1])\n"
                "print(sb.files.read('/home/user/kept.txt'))\n"
                "print(sb.commands.run('cat /proc/[0-9]*/comm | grep -qx sleep && echo alive').stdout.strip())\n")
        env = {**os.environ, **{k: up[k] for k in E2B_VARS}}
        out = subprocess.run([sys.executable, "-c", code, sb.sandbox_id], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.stdout.split() == ["still", "here", "alive"], out.stdout + out.stderr
        assert Sandbox.get_info(sb.sandbox_id).state.value == "running"
        assert bg.pid in [p.pid for p in sb.commands.list()]
    finally:
        sb.kill()


def test_dsec_env_e2b_prints_the_four_lines(up: dict[str, str]) -> None:
    from dsec.compat.e2b.keys import dsec_token_of

    out = subprocess.run([sys.executable, "-m", "dsec.cli.main", "env", "e2b"], capture_output=True, text=True,
                         env={**os.environ, "DSEC_URL": up["DSEC_URL"], "DSEC_TOKEN": up["DSEC_TOKEN"]}, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = dict(line.removeprefix("export ").split("=", 1) for line in out.stdout.splitlines())
    assert lines["E2B_API_URL"] == lines["E2B_SANDBOX_URL"] == up["DSEC_URL"]
    assert lines["E2B_DOMAIN"] == "dsec.invalid"
    assert lines["E2B_API_KEY"].startswith("e2b_") and all(c in "0123456789abcdef" for c in lines["E2B_API_KEY"][4:])
    assert dsec_token_of(lines["E2B_API_KEY"]) == up["DSEC_TOKEN"]
    bad = subprocess.run([sys.executable, "-m", "dsec.cli.main", "env", "e2b"], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "DSEC_TOKEN"}, timeout=60)
    assert bad.returncode == 1 and "no API token" in bad.stderr


# ------------------------------------------------------------ template builds ----


def _dsec_client(up: dict[str, str]) -> object:
    import dsec

    return dsec.Client(up["DSEC_URL"], up["DSEC_TOKEN"])


def _leftovers(up: dict[str, str]) -> list[str]:
    """Build sandboxes still alive (every build deletes its own, whatever the outcome)."""
    with _dsec_client(up) as c:  # type: ignore[attr-defined]
        return [i.id for i in c.list(labels={"dsec.compat": "e2b-build"})]


def test_template_build_from_image_then_create(up: dict[str, str]) -> None:
    """mini-swe-agent's path: Template.exists, else Template().from_image(image) built with
    cpu 2 / 2048 MB, then Sandbox.create(template=name); all through the released client."""
    from e2b import Sandbox, Template

    name = f"swe-{uuid.uuid4().hex[:8]}"
    assert Template.exists(name) is False
    logs: list[str] = []
    tpl = (Template().from_image("tc-base:bookworm")
           .set_envs({"TPL_VAR": "from-template"})
           .run_cmd("echo built-as-$(whoami) > /home/user/built.txt; echo step-output")
           .set_workdir("/srv/app")
           .run_cmd("touch made-here && mkdir -p /opt/tool && echo tool > /opt/tool/v", user="root"))
    info = Template.build(tpl, name, cpu_count=2, memory_mb=2048, on_build_logs=lambda e: logs.append(e.message))
    try:
        assert info.template_id == name and info.build_id
        assert any("step-output" in m for m in logs), logs  # a RUN step's output came as build logs
        assert Template.exists(name) is True
        sb = Sandbox.create(template=name, envs={"OWN": "1"})
        try:
            assert sb.get_info().template_id == name
            assert sb.files.read("/home/user/built.txt") == "built-as-user\n"
            assert sb.files.read("/opt/tool/v") == "tool\n"
            assert sb.files.exists("/srv/app/made-here")
            assert sb.commands.run("echo $TPL_VAR-$OWN").stdout == "from-template-1\n"
        finally:
            sb.kill()
    finally:
        with _dsec_client(up) as c:  # type: ignore[attr-defined]
            c.delete_snapshot(f"e2b-{name}:default")
    assert Template.exists(name) is False
    assert _leftovers(up) == []


def test_mini_swe_agent_shaped_flow(up: dict[str, str]) -> None:
    """What mini-swe-agent's e2b environment (upstream, not in its 2.4.6 release) does: a
    template named after the image (sanitized + 8 hex of its sha256), Template.exists, else
    Template().from_image(image, username=None, password=None) built with cpu 2 / 2048 MB,
    skip_cache=False, tags=None; Sandbox.create(template=..., timeout=3600); commands.run(cmd,
    cwd="/", timeout=30, envs=None) read as stdout + stderr and exit code. The image is given
    as a registry path: the cluster holds it under its last component (`dsec image import`'s
    default name)."""
    import hashlib
    import re

    from e2b import Sandbox, Template

    image = f"registry.example/dsec-{uuid.uuid4().hex[:6]}/tc-base:bookworm"
    name = re.sub(r"[^a-zA-Z0-9-]", "-", image)
    name = re.sub(r"-{3,}", "--", name).lower()[:54].strip("-") + "-" + hashlib.sha256(image.encode()).hexdigest()[:8]
    assert Template.exists(name) is False
    Template.build(Template().from_image(image, username=None, password=None), name, cpu_count=2, memory_mb=2048,
                   skip_cache=False, tags=None)
    try:
        assert Template.exists(name) is True
        sb = Sandbox.create(template=name, timeout=3600)
        try:
            r = sb.commands.run("pwd; ls /etc/debian_version; echo oops >&2", cwd="/", timeout=30, envs=None)
            assert (r.stdout + r.stderr, r.exit_code) == ("/\n/etc/debian_version\noops\n", 0)
            from e2b.sandbox.commands.command_handle import CommandExitException

            with pytest.raises(CommandExitException) as exc:
                sb.commands.run("test -d /nonexistent || exit 4", cwd="/", timeout=30, envs=None)
            assert exc.value.exit_code == 4
        finally:
            sb.kill()
    finally:
        with _dsec_client(up) as c:  # type: ignore[attr-defined]
            c.delete_snapshot(f"e2b-{name}:default")
    assert _leftovers(up) == []


def test_template_build_copies_files(up: dict[str, str], tmp_path: object) -> None:
    """COPY through the released client: the build context is uploaded (a signed PUT), then a
    file into a directory, a directory's contents with an owner and a mode, a relative dest
    under the workdir; a second build finds the files already there."""
    from pathlib import Path

    from e2b import Sandbox, Template

    ctx = Path(str(tmp_path))
    (ctx / "a.txt").write_text("A")
    (ctx / "pkg" / "sub").mkdir(parents=True)
    (ctx / "pkg" / "m.py").write_text("M")
    (ctx / "pkg" / "sub" / "n.txt").write_text("N")
    name = f"copy-{uuid.uuid4().hex[:8]}"
    logs: list[str] = []

    def tpl() -> object:
        return (Template(file_context_path=str(ctx)).from_image("tc-base:bookworm")
                .copy("a.txt", "/home/user/")
                .copy("pkg", "/opt/pkg", user="root", mode=0o750)
                .copy("a.txt", "b.txt"))

    Template.build(tpl(), name, on_build_logs=lambda e: logs.append(e.message))
    assert any("Uploaded" in m for m in logs), logs
    logs.clear()
    Template.build(tpl(), name, on_build_logs=lambda e: logs.append(e.message))  # the same files: no upload
    assert any("already cached" in m for m in logs) and not any("Uploaded" in m for m in logs), logs
    try:
        sb = Sandbox.create(template=name)
        try:
            out = sb.commands.run("cat /home/user/a.txt /opt/pkg/m.py /opt/pkg/sub/n.txt /home/user/b.txt; echo; "
                                  "stat -c '%U %a %n' /home/user/a.txt /opt/pkg/m.py /opt/pkg/sub /home/user/b.txt",
                                  user="root").stdout
            assert out.split("\n")[0] == "AMNA", out
            assert out.split("\n")[1:5] == ["user 644 /home/user/a.txt", "root 750 /opt/pkg/m.py",
                                              "root 750 /opt/pkg/sub", "user 644 /home/user/b.txt"], out
            assert not sb.files.exists("/opt/pkg/pkg") and sb.commands.run("ls -A /tmp").stdout == ""
        finally:
            sb.kill()
    finally:
        with _dsec_client(up) as c:  # type: ignore[attr-defined]
            c.delete_snapshot(f"e2b-{name}:default")
    assert _leftovers(up) == []
    r = httpx.put(up["E2B_API_URL"] + f"/templates/{name}/files/abc?k=x&exp=99999999999&sig=forged", content=b"x",
                  timeout=10)
    assert r.status_code == 403, r.text


def test_template_start_and_ready_commands(up: dict[str, str]) -> None:
    """set_start_cmd: each sandbox of the template starts with it running, its ready command
    passed before the first command; the template's ENV reaches both (all kept in the layer)."""
    from e2b import Sandbox, Template

    name = f"srv-{uuid.uuid4().hex[:8]}"
    ready = "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8000))\""
    tpl = (Template().from_template("base")
           .set_envs({"GREETING": "hello"})
           .run_cmd("mkdir -p /home/user/site && echo $GREETING > /home/user/site/index.html")
           .set_start_cmd("cd /home/user/site && echo $GREETING-started > /home/user/started && "
                          "exec python3 -m http.server 8000 --bind 127.0.0.1", ready))
    Template.build(tpl, name)
    try:
        sb = Sandbox.create(template=name)
        try:
            r = sb.commands.run("cat /home/user/started; python3 -c \"import urllib.request; "
                                "print(urllib.request.urlopen('http://127.0.0.1:8000/').read().decode(), end='')\"")
            assert r.stdout == "hello-started\nhello\n", r.stdout + r.stderr
        finally:
            sb.kill()
    finally:
        with _dsec_client(up) as c:  # type: ignore[attr-defined]
            c.delete_snapshot(f"e2b-{name}:default")
    bad = (Template().from_template("base").set_start_cmd("sleep 600", "exit 1"))
    from e2b.exceptions import BuildException

    with pytest.raises(BuildException, match="ready command did not pass within 5 s"):  # e2b.ready_timeout_s
        Template.build(bad, name + "-bad")
    assert _leftovers(up) == []


def test_template_build_errors_are_typed(up: dict[str, str]) -> None:
    """An image no registry here can give, a failing step, COPY: BuildException with why; no
    sandbox, no template left behind."""
    from e2b import Template
    from e2b.exceptions import BuildException

    name = f"bad-{uuid.uuid4().hex[:8]}"
    with pytest.raises(BuildException, match=r"image 'python:3\.12' cannot be had.*dsec image import"):
        Template.build(Template().from_image("python:3.12").run_cmd("true"), name)
    with pytest.raises(BuildException, match=r"step 2: .*failed \(exit code 3\)"):
        Template.build(Template().from_image("tc-base:bookworm").run_cmd("true").run_cmd("echo no >&2; exit 3"), name)
    # a COPY whose files never came (the client checks its own side first): through the API itself
    api, hdr = up["E2B_API_URL"], {"X-API-KEY": up["E2B_API_KEY"]}
    got = httpx.post(api + "/v3/templates", json={"name": name}, headers=hdr, timeout=30).json()
    r = httpx.post(api + f"/v2/templates/{got['templateID']}/builds/{got['buildID']}", headers=hdr, timeout=30,
                   json={"fromImage": "tc-base:bookworm", "steps": [
                       {"type": "COPY", "args": ["x", "/y", "", ""], "filesHash": "deadbeef", "force": False}]})
    assert r.status_code == 202, r.text
    for _ in range(100):
        st = httpx.get(api + f"/templates/{got['templateID']}/builds/{got['buildID']}/status", headers=hdr,
                       timeout=30).json()
        if st["status"] != "building":
            break
        threading.Event().wait(0.1)
    assert st["status"] == "error" and "were not uploaded" in st["reason"]["message"] and st["reason"]["step"] == "1", st
    with pytest.raises(BuildException, match="template 'no-such' not found"):
        Template.build(Template().from_template("no-such"), name)
    assert Template.exists(name) is False
    assert _leftovers(up) == []
    r = httpx.post(up["E2B_API_URL"] + "/v3/templates", json={"name": "Not A Name"},
                   headers={"X-API-KEY": up["E2B_API_KEY"]}, timeout=10)
    assert r.status_code == 400 and "template name" in r.json()["message"], r.text


# ------------------------------------------------------------ an RL framework's shape ----


def test_slime_shaped_flow(up: dict[str, str]) -> None:
    """slime's agent sandbox (slime/agent/sandbox.py, E2BSandbox): one AsyncSandbox per
    trajectory, the image named by a metadata key, root sets up an unprivileged `agent`
    user, byte uploads as octet-stream without gzip, str writes and reads as `agent`,
    commands with envs and streaming callbacks, a failing command read from
    CommandExitException; 8 trajectories at once, each sees only its own files."""
    import asyncio

    from e2b import AsyncSandbox, SandboxQuery
    from e2b.sandbox.commands.command_handle import CommandExitException

    run = uuid.uuid4().hex[:12]

    async def trajectory(i: int) -> tuple[str, str]:
        sb = await AsyncSandbox.create(timeout=3600, metadata={"image": "tc-base:bookworm", "size": "md", "run": run})
        try:
            r = await sb.commands.run("id agent >/dev/null 2>&1 || useradd -m -s /bin/bash agent; "
                                      "mkdir -p /testbed && chown -R agent:agent /home/agent /testbed && id -u agent",
                                      user="root", timeout=60, on_stdout=lambda s: None, on_stderr=lambda s: None)
            assert r.exit_code == 0 and r.stdout.strip().isdigit()
            blob = bytes([i]) * 300_000 + os.urandom(1000)
            await sb.files.write("/testbed/blob.bin", io.BytesIO(blob), user="agent", gzip=False,
                                 use_octet_stream=True, request_timeout=600)
            await sb.files.write("/testbed/task.py", f"print('trajectory {i}')\n", user="agent")
            seen: list[str] = []
            r = await sb.commands.run("cd /testbed && python3 task.py 2>/dev/null || sed -n 's/.*(.\\(.*\\).)/\\1/p' task.py; "
                                      "echo $RUN_ID; whoami; stat -c '%U %s' blob.bin; sha256sum blob.bin | cut -c1-16",
                                      user="agent", envs={"RUN_ID": f"{run}-{i}"}, timeout=120,
                                      on_stdout=seen.append, on_stderr=lambda s: None)
            assert "".join(seen) == r.stdout
            lines = r.stdout.split("\n")
            import hashlib

            assert lines[1:5] == [f"{run}-{i}", "agent", f"agent {len(blob)}", hashlib.sha256(blob).hexdigest()[:16]], r.stdout
            with pytest.raises(CommandExitException) as exc:
                await sb.commands.run("touch /etc/not-for-agent", user="agent", timeout=30)
            assert exc.value.exit_code != 0 and "Permission denied" in exc.value.stderr
            assert await sb.files.read("/testbed/task.py", user="agent") == f"print('trajectory {i}')\n"
            await sb.files.write("/root/verdict.txt", f"reward={i % 2}", user="root")
            return sb.sandbox_id, await sb.files.read("/root/verdict.txt", user="root")
        finally:
            await sb.kill()

    async def main() -> list[tuple[str, str]]:
        return await asyncio.gather(*(trajectory(i) for i in range(8)))

    out = asyncio.run(main())
    assert len({sid for sid, _ in out}) == 8
    assert [v for _, v in out] == [f"reward={i % 2}" for i in range(8)]
    from e2b import Sandbox

    assert Sandbox.list(query=SandboxQuery(metadata={"run": run})).next_items() == []
