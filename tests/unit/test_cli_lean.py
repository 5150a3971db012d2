"""The CLI's lean parts without a service: what they import, how they name bad flags, how
`dsec cp` reads its arguments, and the lean client against a small HTTP server."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator

import click
import pytest

from dsec.cli.cp import parse
from dsec.cli.execute import flag_message, spec_dict
from dsec.cli.lean import LeanClient
from dsec.errors import DsecError, SandboxNotFound

HEAVY = ("pydantic", "httpx", "rich", "asyncio", "anyio", "fastapi", "sqlalchemy")


def test_the_cli_entry_imports_nothing_heavy() -> None:
    code = ("import sys, dsec.cli.main, dsec.cli.lean, dsec.cli.execute, dsec.cli.cp, dsec.cli.term\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_import_dsec_is_lazy_and_whole() -> None:
    code = ("import sys, dsec\nbefore = 'pydantic' in sys.modules\n"
            "names = [n for n in dsec.__all__ if getattr(dsec, n, None) is None]\n"
            "print(before, names, dsec.Client.__module__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False [] dsec.sdk.sync", r.stderr


@pytest.mark.parametrize(("field", "message", "typed", "line"), [
    ("spec.resources.memory", "Input should be greater than or equal to 16777216", {"--memory": "1M"},
     "--memory 1M: must be at least 16M"),
    ("spec.resources.cpu", "Input should be greater than 0", {"--cpu": "-1"}, "--cpu -1: must be more than 0"),
    ("resources.disk", "Input should be less than or equal to 1099511627776", {}, "--disk: must be at most 1T"),
    ("spec.output_cap", "Input should be greater than or equal to 1024", {"--output-cap": "10"},
     "--output-cap 10: must be at least 1K"),
    ("spec.env.X", "Value error, bad", {}, "--env: bad"),
])
def test_a_bad_value_is_named_by_its_flag(field: str, message: str, typed: dict[str, str], line: str) -> None:
    assert flag_message(field, message, typed) == line


def test_spec_from_flags_carries_only_what_was_given() -> None:
    assert spec_dict("busybox") == {"image": {"base": "busybox"}, "resources": {}, "env": {}}
    s = spec_dict("b", workspace="ws", toolkits=("t",), cpu=0.5, memory=1 << 30, output_cap=2048, env={"A": "1"})
    assert s == {"image": {"base": "b", "workspace": "ws", "toolkits": ["t"]},
                 "resources": {"cpu": 0.5, "memory": 1 << 30}, "env": {"A": "1"}, "output_cap": 2048}


@pytest.mark.parametrize(("arg", "parsed"), [
    ("e1-abc:/root/x", ("e1-abc", "/root/x")),
    ("e1-abc:/", ("e1-abc", "/")),
    ("./a:b", (None, "./a:b")),
    ("/tmp/a:b", (None, "/tmp/a:b")),
    ("dir/a:b", (None, "dir/a:b")),
    ("plain", (None, "plain")),
    ("-", (None, "-")),
])
def test_cp_tells_sandbox_paths_from_local_ones(arg: str, parsed: tuple[str | None, str]) -> None:
    assert parse(arg) == parsed


def test_cp_wants_absolute_sandbox_paths() -> None:
    with pytest.raises(click.UsageError, match="must be absolute"):
        parse("e1-abc:relative/x")


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str, str]] = []

    def log_message(self, *a: object) -> None:
        pass

    def _send(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.seen.append(("GET", self.path, self.headers.get("authorization", "")))
        if self.path == "/v1/sandboxes/e1-gone":
            self._send(200, {"id": "e1-gone", "state": "stopped", "reason": "ttl", "token": None})
        elif self.path == "/v1/sandboxes/e1-none":
            self._send(404, {"error": {"code": "sandbox_not_found", "message": "no sandbox 'e1-none'"}})
        else:
            self._send(200, {"items": [{"id": "e1-a", "state": "running"}]})


@pytest.fixture
def server() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_lean_client_speaks_the_wire_and_its_errors(server: str) -> None:
    _Handler.seen.clear()
    with LeanClient(server, "dsk_t") as c:
        assert c.list(labels={"a": "b"}, state="running") == [{"id": "e1-a", "state": "running"}]
        with pytest.raises(SandboxNotFound, match="e1-none"):
            c.connect("e1-none")
        with pytest.raises(SandboxNotFound, match=r"e1-gone is stopped \(ttl\)"):
            c.connect("e1-gone")
    assert _Handler.seen[0] == ("GET", "/v1/sandboxes?label=a%3Db&state=running", "Bearer dsk_t")


def test_lean_client_names_an_unreachable_service() -> None:
    with LeanClient("http://127.0.0.1:9", "dsk_t") as c, pytest.raises(DsecError) as exc:
        c.list()
    assert str(exc.value).startswith("cannot reach the DSec control plane at http://127.0.0.1:9 (DSEC_URL): ")
