"""The lean HTTP/1.1 client (dsec/http/client.py) against raw asyncio servers: keep-alive, stale
connections, failures, and the options the SDK uses (reuse_unsafe, no timeout)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from dsec.http.client import NO_TIMEOUT, AnswerTimeout, ConnectFailed, EdgeHTTP, NoAnswer

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


def _once_per_connection(requests: list[bytes], conns: list[int]) -> Handler:
    """Answers one request per connection, says keep-alive, then reads the next one and hangs up."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns[0] += 1
        try:
            requests.append(await _read_request(r))
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await w.drain()
            requests.append(await _read_request(r))  # read, then dropped unanswered
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        w.close()

    return handler


async def _keep_alive(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Answers every request on the connection; echoes the request line as the body."""
    try:
        while True:
            req = await _read_request(r)
            line = req.split(b"\r\n", 1)[0]
            if line.startswith(b"HEAD "):  # the length of the body it would have had, and none
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
            elif b"/empty " in line:
                w.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            else:
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(line), line))
            await w.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        w.close()


async def test_reuse_unsafe_reuses_connections_for_every_request() -> None:
    conns = 0

    async def counting(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        await _keep_alive(r, w)

    server, url = await serve(counting)
    async with server:
        default = EdgeHTTP(url, size=4, timeout=5, connect_timeout=1)
        for _ in range(3):  # the control plane's default: not safe to repeat -> a fresh connection each
            assert (await default.request("POST", "/fork", headers={}, body=b"{}", retry_stale=False)).status_code == 200
        assert conns == 3 and default.reused == 0
        await default.aclose()

        conns = 0
        sdk = EdgeHTTP(url, size=4, timeout=5, connect_timeout=1, max_idle_s=20, reuse_unsafe=True)
        for _ in range(3):
            assert (await sdk.request("POST", "/exec", headers={}, body=b"{}", retry_stale=False)).status_code == 200
        assert conns == 1 and sdk.reused == 2
        await sdk.aclose()
        await sdk.aclose()  # closing twice is fine


async def test_reuse_unsafe_retries_a_stale_connection_only_when_safe() -> None:
    requests: list[bytes] = []
    conns = [0]
    server, url = await serve(_once_per_connection(requests, conns))
    async with server:
        h = EdgeHTTP(url, size=4, timeout=5, connect_timeout=1, max_idle_s=20, reuse_unsafe=True)
        assert (await h.request("GET", "/a", headers={})).status_code == 200
        await asyncio.sleep(0.05)
        # not safe to repeat: it met the stale connection and fails; sent once, never resent
        with pytest.raises(NoAnswer, match="not safe to repeat"):
            await h.request("POST", "/exec", headers={}, body=b"{}", retry_stale=False)
        assert [q.split(b" ")[1] for q in requests] == [b"/a", b"/exec"]
        assert h.stale_retries == 0
        # safe to repeat: the stale connection is replaced and the request resent
        assert (await h.request("GET", "/b", headers={})).status_code == 200
        await asyncio.sleep(0.05)
        assert (await h.request("GET", "/c", headers={})).status_code == 200
        assert [q.split(b" ")[1] for q in requests] == [b"/a", b"/exec", b"/b", b"/c", b"/c"]
        assert h.stale_retries == 1 and conns[0] == 3
        await h.aclose()


async def test_no_timeout_and_the_default_timeout() -> None:
    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        await asyncio.sleep(0.4)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\ndone")
        await w.drain()
        w.close()

    server, url = await serve(slow)
    async with server:
        h = EdgeHTTP(url, size=2, timeout=0.1, connect_timeout=1)
        with pytest.raises(AnswerTimeout) as info:  # None: the pool's timeout
            await h.request("POST", "/exec", headers={}, body=b"{}", timeout=None)
        assert isinstance(info.value, NoAnswer) and isinstance(info.value, TimeoutError)
        answer = await h.request("POST", "/exec", headers={}, body=b"{}", timeout=NO_TIMEOUT)
        assert answer.content == b"done"
        with pytest.raises(AnswerTimeout):
            await h.request("POST", "/exec", headers={}, body=b"{}", timeout=0.05)
        await h.aclose()


async def test_query_strings_head_and_204_keep_the_connection() -> None:
    server, url = await serve(_keep_alive)
    async with server:
        h = EdgeHTTP(url + "/base/", size=2, timeout=5, connect_timeout=1)
        a = await h.request("GET", "/files?path=%2Ftmp%2Fa+b&mode=644", headers={})
        assert a.content == b"GET /base/files?path=%2Ftmp%2Fa+b&mode=644 HTTP/1.1"
        assert a.url == url + "/base/files?path=%2Ftmp%2Fa+b&mode=644"
        head = await h.request("HEAD", "/files", headers={})
        assert head.status_code == 200 and head.content == b"" and head.headers["content-length"] == "1000"
        empty = await h.request("DELETE", "/empty", headers={})
        assert empty.status_code == 204 and empty.content == b""
        empty_body = await h.request("POST", "/resume", headers={}, body=b"")
        assert empty_body.content == b"POST /base/resume HTTP/1.1"
        assert h.reused == 3  # all four on one connection
        await h.aclose()


async def test_a_large_body_goes_out_whole() -> None:
    got: list[int] = []

    async def sink(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        req = await _read_request(r)
        got.append(len(req.split(b"\r\n\r\n", 1)[1]))
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        await w.drain()
        w.close()

    server, url = await serve(sink)
    async with server:
        h = EdgeHTTP(url, size=1, timeout=5, connect_timeout=1)
        assert (await h.request("PUT", "/files", headers={}, body=b"x" * 3_000_000)).status_code == 200
        assert got == [3_000_000]
        await h.aclose()


async def test_a_cancelled_request_is_never_answered_even_as_its_connection_completes() -> None:
    """Python 3.11's ``wait_for`` hands back a future that completed as its caller was cancelled,
    swallowing the cancellation: a request given up at the instant its connection opened went on
    and was answered (a SWE-ReX start given up after 1 ms made its sandbox). A cancelled request
    must end cancelled, whenever the cancellation lands."""
    async def answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await _read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client gave up first
        finally:
            w.close()

    server, url = await serve(answer)
    swallowed = cancelled = 0
    try:
        for i in range(400):
            http = EdgeHTTP(url, size=1, timeout=5, connect_timeout=1)
            t = asyncio.create_task(http.request("GET", "/", headers={}))
            for _ in range(i % 8):  # land the cancellation at each step of connecting
                await asyncio.sleep(0)
            if not t.cancel():
                await t
                continue
            cancelled += 1
            try:
                await t
            except asyncio.CancelledError:
                continue
            swallowed += 1
    finally:
        server.close()
    assert cancelled > 100
    assert swallowed == 0, f"{swallowed} of {cancelled} cancelled requests were answered"
