"""A lean HTTP/1.1 client for the control plane's calls to edges.

The control plane makes one edge call per sandbox it creates, so the client's
own cost is on the hot path of every burst. httpx spends ~2 ms of CPU per
request here (its pool walks every connection and probes each socket on
every request); this client writes the request in one go, parses the answer
with httptools (the C parser uvicorn uses) and keeps a few connections per
edge alive. It speaks just what the edge admin API needs: a JSON or empty
body out, a body with Content-Length or chunked back. ``https://`` edges go
through httpx instead (see EdgeClient).

Failures are sorted for the caller: :class:`ConnectFailed` (nothing was sent:
safe to try elsewhere) and :class:`NoAnswer` (sent, then no complete answer:
the request may have happened).

Reusing a kept-alive connection races with the server closing it (uvicorn
closes idle ones after ``timeout_keep_alive``): the request goes out, and the
answer is an EOF or a reset. Two defences: a connection idle longer than
``max_idle_s`` (well under any edge's keep-alive timeout) or already at EOF
is never reused, and a failure before the first answer byte on a reused
connection is retried on a fresh one — but only for a request that is safe to
repeat (``retry_stale``: idempotent, or de-duplicated by the edge such as a
create carrying its request_id). Other requests (fork, snapshot) always go
on a fresh connection, so they never meet a stale one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httptools


class ConnectFailed(OSError):
    pass


class NoAnswer(OSError):
    pass


@dataclass
class Answer:
    status_code: int
    headers: dict[str, str] = field(default_factory=dict)
    content: bytes = b""

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


class _Parse:
    """httptools callbacks collecting one response."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.done = False
        self.keep_alive = False
        self.parser: Any = None

    def on_headers_complete(self) -> None:
        # read it here: once the message is complete the parser has reset
        self.keep_alive = bool(self.parser.should_keep_alive())

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
    """Keep-alive connections to one edge (``http://host:port``), at most ``size`` in flight."""

    def __init__(
        self, base: str, *, size: int, timeout: float, connect_timeout: float, max_idle_s: float = 2.0
    ) -> None:
        u = urlsplit(base)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"EdgeHTTP speaks plain http only, not {base!r}")
        self.host = u.hostname
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self._host_header = f"{u.hostname}:{self.port}".encode()
        self._idle: list[_Conn] = []
        self._size = size
        self._sem = asyncio.Semaphore(size)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_idle_s = max_idle_s
        self.reused = 0
        self.stale_retries = 0

    async def _connect(self) -> _Conn:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, limit=1 << 20), self.connect_timeout
            )
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
        async with self._sem:
            if retry_stale:
                conn = self._take_idle()
                if conn is not None:
                    self.reused += 1
                    try:
                        return await self._once(conn, method, path, headers, body, timeout)
                    except _Stale:
                        self.stale_retries += 1  # closed by the edge as we reused it: nothing was answered
            try:
                return await self._once(await self._connect(), method, path, headers, body, timeout)
            except _Stale:
                raise NoAnswer(f"{self.host}:{self.port} closed the connection without answering") from None

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
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
        try:
            head = self._head(method, path, headers, None if body is None else len(body))
            conn.writer.write(head + body if body else head)  # one segment: no Nagle/delayed-ACK stall
            p = _Parse()
            parser = p.parser = httptools.HttpResponseParser(p)
            async with asyncio.timeout(self.timeout if timeout is None else timeout):
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
            return Answer(parser.get_status_code(), p.headers, b"".join(p.body))
        except (_Stale, NoAnswer):
            raise
        except TimeoutError:
            raise NoAnswer(f"{self.host}:{self.port} did not answer in time") from None
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
        idle, self._idle = self._idle, []
        for c in idle:
            c.close()


class _Stale(Exception):
    pass
