"""A user's own server in a sandbox, reached through the front: ``E2b-Sandbox-Port: <port>``
(or a ``<port>-<id>.<domain>`` Host, what E2B's ``get_host(port)`` gives) on any port but
envd's and code-interpreter's.

A sandbox's network is its own (loopback only unless a policy says more), and the edge
offers no port forwarding; so each request is relayed by a command in the sandbox: bash
connects to ``127.0.0.1:<port>`` (``/dev/tcp``) and pipes the request in and the answer out,
over one attached command (``AsyncSandbox.attach``). The request goes with
``Connection: close``, its body streamed (re-framed as chunked when the client sent no
length); the answer is parsed as it comes (httptools) and streamed back, its own framing
replaced by the front's. One command per request: fine for a user's dev server or an RL
task's service, not a data path (each costs an exec). No WebSocket or other upgrade.

E2B's cloud lets anyone reach a sandbox's ports unless it was created with
``allow_public_traffic=False``; here every request needs the sandbox's
``E2B-Traffic-Access-Token`` (or ``X-Access-Token``): one project's callers never reach
another's sandbox. A port nothing listens on answers 502 "... port <p> is not open".
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import httptools

if TYPE_CHECKING:
    from dsec.compat.e2b.rooms import Room

RELAY = 'exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 97; cat <&3 & cat >&3; wait $!'
"""bash: connect, print what the server answers until it closes (in the background: a
background command's own stdin is /dev/null), send it stdin meanwhile."""
NOT_LISTENING = 97
_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te", b"trailer", b"upgrade",
        b"proxy-authorization", b"proxy-authenticate"}
_ROUTING = {b"e2b-sandbox-id", b"e2b-sandbox-port", b"x-access-token", b"e2b-traffic-access-token"}
MAX_HEAD = 64 * 1024
"""Bytes of the answer's status line and headers at most."""


class _Parser:
    """httptools' callbacks, gathered: the head, then body chunks as they come."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.done = False
        self.body: list[bytes] = []
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


def _head(scope: dict[str, Any], port: int, chunked: bool) -> bytes:
    path = scope.get("raw_path") or scope.get("path", "/").encode()
    qs = scope.get("query_string", b"")
    target = path + (b"?" + qs if qs else b"")
    lines = [scope["method"].encode() + b" " + target + b" HTTP/1.1"]
    host = False
    for name, value in scope.get("headers", []):
        n = name.lower()
        if n in _HOP or n in _ROUTING:
            continue
        host = host or n == b"host"
        lines.append(n + b": " + value)
    if not host:
        lines.append(f"host: 127.0.0.1:{port}".encode())
    if chunked:
        lines.append(b"transfer-encoding: chunked")
    lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def proxy(room: Room, port: int, scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Relay one HTTP request to ``127.0.0.1:port`` inside the sandbox and its answer back."""
    from starlette.responses import JSONResponse

    headers = {k.lower(): v for k, v in scope.get("headers", [])}
    if b"upgrade" in headers:
        await JSONResponse({"code": 501, "message": "DSec's E2B front relays plain HTTP requests to a sandbox's "
                                                    "ports, not upgrades (WebSocket)"}, status_code=501)(
            scope, receive, send)
        return
    chunked = b"content-length" not in headers and scope["method"] not in ("GET", "HEAD", "DELETE", "OPTIONS")
    term = await room.handle.attach(["/bin/bash", "-c", RELAY, "relay", str(port)])
    p = _Parser()
    started = False
    stderr = bytearray()

    async def feed() -> None:
        await term.send(_head(scope, port, chunked))
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                await term.signal("KILL")
                return
            body = msg.get("body", b"")
            if body:
                await term.send(b"%x\r\n%s\r\n" % (len(body), body) if chunked else body)
            if not msg.get("more_body", False):
                break
        if chunked:
            await term.send(b"0\r\n\r\n")
        await term.eof()

    feeder = asyncio.get_running_loop().create_task(feed(), name=f"e2b-port-{room.id}-{port}")
    try:
        size = 0
        async for chunk in term.output():
            if chunk.stream == "stderr":
                stderr += chunk.data[: 4096 - len(stderr)]
                continue
            if p.done:
                continue
            try:
                p.parser.feed_data(chunk.data)
            except httptools.HttpParserError as exc:
                if not started:
                    await JSONResponse({"code": 502, "message": f"the server on port {port} of sandbox {room.id} "
                                                                f"answered no HTTP: {exc}"}, status_code=502)(
                        scope, receive, send)
                    started = True
                break
            size += len(chunk.data)
            if not p.head_done and size > MAX_HEAD:
                break
            if p.head_done and not started:
                out = [(n.lower(), v) for n, v in p.headers if n.lower() not in _HOP]
                await send({"type": "http.response.start", "status": p.parser.get_status_code(), "headers": out})
                started = True
            if started and p.body:
                data, p.body = b"".join(p.body), []
                await send({"type": "http.response.body", "body": data, "more_body": True})
        ex = await term.wait()
        if not started:
            why = stderr.decode(errors="replace").strip()
            if ex.exit_code == NOT_LISTENING or "connect" in why.lower():
                msg = f"The sandbox {room.id} port {port} is not open: nothing listens on 127.0.0.1:{port} in it"
            elif ex.exit_code == 127:
                msg = f"sandbox {room.id} has no bash to relay port {port} with"
            else:
                msg = f"the server on port {port} of sandbox {room.id} sent no answer ({why[:300] or ex})"
            await JSONResponse({"code": 502, "message": msg}, status_code=502)(scope, receive, send)
            return
        if p.body:
            await send({"type": "http.response.body", "body": b"".join(p.body), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except Exception:
        if not started:
            raise  # the front answers it (a gone sandbox: 502 "was not found")
        # the answer is under way: end it where it stands (the client sees it cut short)
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        feeder.cancel()
        with contextlib.suppress(BaseException):
            await feeder
        with contextlib.suppress(Exception):
            await term.close()
