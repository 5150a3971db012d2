"""A lean HTTP/1.1 keep-alive client, shared by the SDK and the control plane.

Both sit on hot paths where the HTTP client's own cost shows: the control
plane makes one edge call per sandbox it creates, the SDK one call per create
and per exec. A keep-alive round trip through httpx costs ~0.45 ms on the
2-core test machine, and ~2 ms of CPU under the control plane's load (its pool
walks every connection and probes each socket on every request); this client
writes the request in one go, parses the answer with httptools (the C parser
uvicorn uses) and keeps connections alive: ~0.08 ms. It speaks just what those
calls need: a bytes or empty body out (a query string rides in the path), a
body with Content-Length or chunked back (none for HEAD, 204, 304). No TLS, no
streaming, no redirects: ``https://``, streams and custom transports go
through httpx (EdgeClient in control/edges.py, sdk/_http.py).

Failures are sorted for the caller: :class:`ConnectFailed` (nothing was sent:
safe to try elsewhere) and :class:`NoAnswer` (sent, then no complete answer:
the request may have happened; :class:`AnswerTimeout` when time ran out).

Reusing a kept-alive connection races with the server closing it (uvicorn
closes idle ones after ``timeout_keep_alive``): the request goes out, and the
answer is an EOF or a reset. Two defences: a connection idle longer than
``max_idle_s`` (well under the server's keep-alive timeout) or already at EOF
is never reused, and a failure before the first answer byte on a reused
connection is retried on a fresh one — but only for a request that is safe to
repeat (``retry_stale``: idempotent, or de-duplicated by the server such as a
create carrying its request_id). Other requests (the control plane's fork and
snapshot) go on a fresh connection, so they never meet a stale one; a client
made with ``reuse_unsafe=True`` (the SDK, which cannot afford a TCP connect per
exec) reuses connections for them too, and a stale one fails them with
NoAnswer, as httpx would.

Never blocks the event loop; never retries a request that is not safe to repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import httptools

NO_TIMEOUT: Final = math.inf
"""``timeout=NO_TIMEOUT``: wait for the answer as long as it takes (``None`` is the pool's default)."""

_ONE_WRITE = 64 * 1024
"""Bodies up to this size go out in one segment with the head (no Nagle/delayed-ACK stall)."""


class ConnectFailed(OSError):
    pass


class NoAnswer(OSError):
    pass


class AnswerTimeout(NoAnswer, TimeoutError):
    pass


@dataclass
class Answer:
    status_code: int
    headers: dict[str, str] = field(default_factory=dict)
    """Lower-cased names; a repeated header keeps its last value."""
    content: bytes = b""
    url: str = ""

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


class _Parse:
    """httptools callbacks collecting one response."""

    def __init__(self, head_only: bool) -> None:
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.done = False
        self.keep_alive = False
        self.head_only = head_only
        self.parser: Any = None

    def on_headers_complete(self) -> None:
        # read it here: once the message is complete the parser has reset
        self.keep_alive = bool(self.parser.should_keep_alive())
        if self.head_only:  # an answer to HEAD has no body, whatever its Content-Length says
            self.done = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def reusable(self, now: float, max_idle_s: float) -> bool:
        return (
            now - self.idle_since < max_idle_s
            and not self.reader.at_eof()
            and not self.writer.is_closing()
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class EdgeHTTP:
    """Keep-alive connections to one server (``http://host:port``), at most ``size`` in flight
    and at most ``size`` kept idle.

    ``reuse_unsafe``: requests that are not safe to repeat reuse idle connections too
    (see the module docstring). ``max_idle_s`` must stay below the server's keep-alive timeout.
    """

    def __init__(
        self, base: str, *, size: int, timeout: float, connect_timeout: float, max_idle_s: float = 2.0,
        reuse_unsafe: bool = False,
    ) -> None:
        u = urlsplit(base)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"EdgeHTTP speaks plain http only, not {base!r}")
        self.host = u.hostname
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        netloc = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        self._host_header = netloc.encode()
        self._base = f"http://{netloc}{self.prefix}"
        self._idle: deque[_Conn] = deque()
        self._size = size
        self._sem = asyncio.Semaphore(size)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_idle_s = max_idle_s
        self.reuse_unsafe = reuse_unsafe
        self.reused = 0
        self.stale_retries = 0

    async def _connect(self) -> _Conn:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns a connection that completed
        # as the caller was cancelled, swallowing the caller's cancellation (fixed in 3.12)
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc!r}") from None
        return _Conn(reader, writer)

    def _head(self, method: str, path: str, headers: dict[str, str], length: int | None) -> bytes:
        lines = [f"{method} {self.prefix}{path} HTTP/1.1".encode(), b"Host: " + self._host_header]
        lines += [f"{k}: {v}".encode("latin-1") for k, v in headers.items()]
        if length is not None:
            lines.append(b"Content-Length: %d" % length)
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def request(
        self, method: str, path: str, *, headers: dict[str, str], body: bytes | None = None,
        timeout: float | None = None, retry_stale: bool = True,
    ) -> Answer:
        """One request; ``path`` may carry a query string. ``timeout``: seconds for the whole
        answer, ``None`` the pool's default, :data:`NO_TIMEOUT` none. ``retry_stale``: the
        request is safe to repeat, so a kept-alive connection found dead is retried on a fresh one."""
        async with self._sem:
            conn = self._take_idle() if retry_stale or self.reuse_unsafe else None
            if conn is not None:
                self.reused += 1
                try:
                    return await self._once(conn, method, path, headers, body, timeout)
                except _Stale:
                    # closed by the server as we reused it: nothing was answered, but it may have been read
                    if not retry_stale:
                        raise NoAnswer(
                            f"{self.host}:{self.port} closed a kept-alive connection without answering "
                            f"{method} {path} (not retried: not safe to repeat)"
                        ) from None
                    self.stale_retries += 1
            try:
                return await self._once(await self._connect(), method, path, headers, body, timeout)
            except _Stale:
                raise NoAnswer(f"{self.host}:{self.port} closed the connection without answering") from None

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        idle = self._idle
        while idle and now - idle[0].idle_since >= self.max_idle_s:  # the oldest: close, do not keep
            idle.popleft().close()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be closing
            if conn.reusable(now, self.max_idle_s):
                return conn
            conn.close()
        return None

    async def _once(
        self, conn: _Conn, method: str, path: str, headers: dict[str, str], body: bytes | None,
        timeout: float | None,
    ) -> Answer:
        keep = False
        got_any = False
        if timeout is None:
            timeout = self.timeout
        try:
            head = self._head(method, path, headers, None if body is None else len(body))
            if not body:
                conn.writer.write(head)
            elif len(body) <= _ONE_WRITE:
                conn.writer.write(head + body)  # one segment: no Nagle/delayed-ACK stall
            else:  # not joined: that would copy a large body once more
                conn.writer.write(head)
                conn.writer.write(body)
            p = _Parse(head_only=method == "HEAD")
            parser = p.parser = httptools.HttpResponseParser(p)
            async with asyncio.timeout(None if timeout == NO_TIMEOUT else timeout):
                await conn.writer.drain()
                while not p.done:
                    data = await conn.reader.read(65536)
                    if not data:
                        if not got_any:
                            raise _Stale
                        raise NoAnswer(f"{self.host}:{self.port} closed the connection mid-answer")
                    got_any = True
                    parser.feed_data(data)
            keep = p.keep_alive
            return Answer(parser.get_status_code(), p.headers, b"".join(p.body), self._base + path)
        except (_Stale, NoAnswer):
            raise
        except TimeoutError:
            raise AnswerTimeout(f"{self.host}:{self.port} did not answer in {timeout} s") from None
        except OSError as exc:
            if not got_any:  # reset or broken pipe before any answer: the connection was stale
                raise _Stale from None
            raise NoAnswer(f"{self.host}:{self.port}: {exc!r}") from None
        except httptools.HttpParserError as exc:
            raise NoAnswer(f"{self.host}:{self.port}: bad answer: {exc!r}") from None
        finally:
            if keep and len(self._idle) < self._size:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                conn.close()

    async def aclose(self) -> None:
        """Close the idle connections (closing twice is fine)."""
        idle, self._idle = self._idle, deque()
        for c in idle:
            c.close()


class _Stale(Exception):
    pass
