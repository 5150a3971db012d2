"""Limits on what one HTTP request may make a DSec server hold in memory.

uvicorn's httptools protocol accepts a header section of any size and any number
of headers (an 8 MiB header or 10,000 headers were answered 200 by the edge
before any authentication: the abuse suite's ``edge_header_flood``). The
protocol below counts the bytes of each request's head as they arrive and
answers ``431`` and closes the connection past :data:`MAX_HEAD_BYTES` or
:data:`MAX_HEADERS`, before the parser has buffered more than that.

Bodies are the routes' business: :func:`read_body` refuses a declared or
streamed body over a limit with :class:`~dsec.errors.PayloadTooLarge` (413)
without buffering more than the limit.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dsec.errors import PayloadTooLarge

MAX_HEAD_BYTES = 64 * 1024
"""Request line plus headers (nginx's default large_client_header_buffers is 4 x 8 KiB)."""
MAX_HEADERS = 128

_431 = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a refused request."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bounded request head (pass as ``http=``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._in_head = True
        self._n_headers = 0
        self._refused = False
        self._tail = b""

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            # Only the head counts: it ends at the first blank line (the body may come
            # in the same chunk). The last 3 bytes of the previous chunk catch a
            # CRLFCRLF split across chunks.
            seen = self._tail + data
            end = seen.find(b"\r\n\r\n")
            head = len(data) if end < 0 else max(0, end + 4 - len(self._tail))
            self._head_bytes += head
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(f"request head over {MAX_HEAD_BYTES} bytes")
                return
            self._tail = seen[-3:] if end < 0 else b""
        super().data_received(data)

    def on_message_begin(self) -> None:
        self._in_head = True
        self._n_headers = 0
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._n_headers += 1
        if self._n_headers > MAX_HEADERS:
            self._refuse(f"more than {MAX_HEADERS} headers")
            # Stop the parser here: it would otherwise call back for every header left
            # in the buffer. httptools turns this into HttpParserCallbackError, which
            # uvicorn's data_received catches (its 400 goes to a closed transport).
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._in_head = False
        self._head_bytes = 0
        self._tail = b""
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self._refused:
            return
        super().on_message_complete()
        self._in_head = True  # a pipelined next request starts its head now

    def _refuse(self, why: str) -> None:
        self._refused = True
        body = (b'{"error": {"code": "too_large", "message": "%s"}}' % why.encode())
        if not self.transport.is_closing():
            self.transport.write(_431 % (len(body), body))
            self.transport.close()


async def read_body(request: Request, limit: int, *, what: str = "request body") -> bytes:
    """The body, refused with PayloadTooLarge once it (declared or streamed) passes ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"{what} of {int(declared)} bytes is over the {limit}-byte limit", limit=limit)
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(f"{what} is over the {limit}-byte limit", limit=limit)
        chunks.append(chunk)
    return b"".join(chunks)


JSON_BODY_LIMIT = 16 << 20
"""Largest body of a JSON route (specs, exec requests with stdin): 16 MiB."""


class BodyLimit:
    """ASGI middleware: bodies of routes not in ``exempt`` (path suffixes, e.g. the
    files routes, which cap by the sandbox's quota themselves) stop at ``limit`` bytes:
    413 at once when Content-Length says more, or as soon as a streamed body passes
    it, before any of it is parsed (a 64 MiB JSON body used to be read and parsed
    whole by the event loop the neighbours' execs share)."""

    def __init__(self, app: Any, *, limit: int = JSON_BODY_LIMIT, exempt: tuple[str, ...] = ()) -> None:
        self.app = app
        self.limit = limit
        self.exempt = exempt

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"].endswith(self.exempt):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._refuse(send, f"request body of {int(value)} bytes is over the {self.limit}-byte limit")
                return
        seen = 0
        over = False

        async def limited_receive() -> Any:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    over = True
                    raise PayloadTooLarge(f"request body is over the {self.limit}-byte limit", limit=self.limit)
            return message

        async def refusing_send(message: Any) -> None:
            # Past the limit the answer is this 413, whatever the app made of the exception
            # (FastAPI turns an error while it reads a body into a 400).
            if not over:
                await send(message)
            elif message["type"] == "http.response.start":
                await self._refuse(send, f"request body is over the {self.limit}-byte limit")

        await self.app(scope, limited_receive, refusing_send)

    async def _refuse(self, send: Any, why: str) -> None:
        import json

        body = json.dumps({"error": {"code": "too_large", "message": why, "limit": self.limit}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
