"""The lean edge HTTP client against raw asyncio servers: keep-alive, stale connections, failures."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from dsec.control.edgehttp import ConnectFailed, EdgeHTTP, NoAnswer

pytestmark = pytest.mark.anyio

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _read_request(r: asyncio.StreamReader) -> bytes:
    head = await r.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + (await r.readexactly(length) if length else b"")


async def serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def test_keep_alive_json_and_chunked() -> None:
    seen: list[bytes] = []
    conns = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        try:
            while True:
                req = await _read_request(r)
                seen.append(req)
                if b"/chunked" in req:
                    w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
                else:
                    body = b'{"ok": true}'
                    w.write(b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                            % (len(body), body))
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    server, url = await serve(handler)
    async with server:
        h = EdgeHTTP(url, size=4, timeout=5, connect_timeout=1)
        a = await h.request("POST", "/v1/sandboxes", headers={"authorization": "Bearer t"}, body=b'{"x":1}')
        assert a.status_code == 201 and a.json() == {"ok": True} and a.headers["content-type"] == "application/json"
        b = await h.request("GET", "/chunked", headers={})
        assert b.status_code == 200 and b.content == b"hello world"
        assert conns == 1  # both on one kept-alive connection
        assert seen[0].startswith(b"POST /v1/sandboxes HTTP/1.1\r\n") and seen[0].endswith(b'{"x":1}')
        assert b"authorization: Bearer t" in seen[0] and b"Content-Length: 7" in seen[0]
        await h.aclose()


async def test_a_connection_closed_by_the_server_is_replaced_once() -> None:
    conns = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        await _read_request(r)
        w.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await w.drain()
        w.close()  # without saying "connection: close": the client finds out on its next request

    server, url = await serve(handler)
    async with server:
        h = EdgeHTTP(url, size=2, timeout=5, connect_timeout=1)
        for _ in range(3):
            assert (await h.request("DELETE", "/v1/sandboxes/x", headers={})).status_code == 204
        assert conns == 3
        await h.aclose()


async def test_failures_say_whether_the_request_may_have_happened() -> None:
    server, url = await serve(lambda r, w: asyncio.sleep(0))
    server.close()
    await server.wait_closed()
    h = EdgeHTTP(url, size=1, timeout=1, connect_timeout=1)
    with pytest.raises(ConnectFailed):  # nothing sent: safe to place elsewhere
        await h.request("POST", "/v1/sandboxes", headers={}, body=b"{}")

    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        await asyncio.sleep(5)

    server, url = await serve(slow)
    async with server:
        h = EdgeHTTP(url, size=1, timeout=0.2, connect_timeout=1)
        with pytest.raises(NoAnswer):  # sent, no answer: it may have happened
            await h.request("POST", "/v1/sandboxes", headers={}, body=b"{}")

    async def half(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await w.drain()
        w.close()

    server, url = await serve(half)
    async with server:
        h = EdgeHTTP(url, size=1, timeout=1, connect_timeout=1)
        with pytest.raises(NoAnswer):
            await h.request("GET", "/v1/health", headers={})
    with pytest.raises(ValueError):
        EdgeHTTP("https://edge:1", size=1, timeout=1, connect_timeout=1)


async def test_requests_that_are_not_safe_to_repeat_never_meet_a_reused_connection() -> None:
    """A server that answers once per connection and then closes without a word: an idempotent
    request on the dead kept-alive connection is retried on a fresh one; a non-idempotent one
    (fork, snapshot) went on a fresh connection in the first place, so it is sent exactly once."""
    requests: list[bytes] = []
    conns = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        try:
            requests.append(await _read_request(r))
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")  # says keep-alive, then hangs up
            await w.drain()
            await r.read(1)  # the next request on this connection is read and dropped
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        w.close()

    server, url = await serve(handler)
    async with server:
        h = EdgeHTTP(url, size=4, timeout=5, connect_timeout=1)
        assert (await h.request("GET", "/a", headers={})).status_code == 200
        await asyncio.sleep(0.05)
        assert (await h.request("GET", "/b", headers={})).status_code == 200  # stale reuse, retried
        assert (await h.request("POST", "/fork", headers={}, body=b"{}", retry_stale=False)).status_code == 200
        assert [q.split(b" ")[1] for q in requests] == [b"/a", b"/b", b"/fork"]
        assert conns == 3 and h.reused == 1 and h.stale_retries == 1  # /b: reused, dropped, resent fresh
        # a connection idle longer than max_idle_s is not reused at all
        h.max_idle_s = 0.0
        before = h.reused
        assert (await h.request("GET", "/c", headers={})).status_code == 200
        assert h.reused == before
        await h.aclose()
