"""The host side of the guest agent: :class:`AgentClient` over QEMU's chardev socket.

QEMU runs ``-chardev socket,id=ag,path=<sock>,server=on,wait=off -device
virtio-serial-device -device virtserialport,chardev=ag,name=dsec.agent``; this module
connects to ``<sock>`` and speaks :mod:`~dsec.backends.microvm.agentwire` (v1) with the
guest's ``dsec-vmagent``. One client per connection; many requests run at once, each on
its own channel (request id).

What it guarantees: nothing waits forever. Every answer has a timeout, and when the
connection drops (QEMU died, the guest powered off) or the agent resets its side (an
``H`` frame after traffic), every pending call fails with :class:`~dsec.errors.HostError`
naming the sandbox. File-op failures raise :class:`~dsec.errors.FileAccessError` with the
same message shape as the container backend's files (``fsops.file_error``); an exec that
cannot start raises :class:`~dsec.errors.ExecError`. Output is credit-controlled end to
end: an exec's output held here (not yet taken by the caller) never exceeds its window.

Never blocks the event loop; holds no lock across an await on the guest.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as errno_mod
import itertools
import stat as stat_mod
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Final

from dsec.backends.base import FileInfo
from dsec.backends.common.fsops import file_error
from dsec.backends.microvm import agentwire as w
from dsec.errors import ExecError, FileAccessError, HostError, InvalidSpec

AgentExit = w.Exit
"""An exec's end: ``code`` (-1 when killed), ``signal`` (0 when it exited), ``utime_s``,
``stime_s``, ``maxrss_kb``."""

ANSWER_TIMEOUT: Final = 30.0
CHUNK: Final = w.MAX_FRAME
_KINDS: Final = {"f": "file", "d": "dir", "l": "symlink", "o": "other"}

OutputCallback = Callable[[bytes], None]


class _Channel:
    """One request id's frames, as the reader task routes them."""

    def __init__(self, chan: int) -> None:
        self.chan = chan
        self.answer: asyncio.Future[w.Answer] = asyncio.get_running_loop().create_future()

    def on_frame(self, ftype: int, payload: bytes) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        if not self.answer.done():
            self.answer.set_exception(exc)
            self.answer.exception()  # retrieved: the caller may be gone, or raise it another way


class AgentClient:
    """A connection to one guest's agent. ``sandbox_id`` names it in errors."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, sandbox_id: str = "",
                 path: Path | None = None) -> None:
        self.sandbox_id = sandbox_id
        self.path = path
        self._reader = reader
        self._writer = writer
        self._chans: dict[int, _Channel] = {}
        self._ids = itertools.count(1)
        self._frames = w.FrameReader()
        self._dead: HostError | None = None
        self._traffic = False
        self.last_hello: w.Hello | None = None
        self._hello_event = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._read_loop(), name=f"vmagent-{sandbox_id}")

    # ------------------------------------------------------------ lifetime ----

    @classmethod
    async def connect(cls, path: Path | str, timeout: float = 10.0, *, sandbox_id: str = "") -> AgentClient:
        """Connect to the chardev socket, retrying while QEMU has not created it yet."""
        deadline = time.monotonic() + timeout
        last: OSError | None = None
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(path), limit=4 * w.MAX_FRAME)
                return cls(reader, writer, sandbox_id=sandbox_id, path=Path(path))
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                last = exc
            if time.monotonic() >= deadline:
                raise HostError(f"sandbox {sandbox_id}: no agent socket at {path} after {timeout:g} s ({last})",
                                sandbox_id=sandbox_id, path=str(path))
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        """Close the connection (idempotent). The guest's processes keep running."""
        self._die(HostError(f"sandbox {self.sandbox_id}: the agent connection was closed",
                            sandbox_id=self.sandbox_id))
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task

    @property
    def alive(self) -> bool:
        return self._dead is None

    @property
    def open_channels(self) -> int:
        """Requests, transfers and execs in flight (0: the guest has nothing of ours running)."""
        return len(self._chans)

    # ------------------------------------------------------------ plumbing ----

    def _die(self, exc: HostError) -> None:
        if self._dead is None:
            self._dead = exc
        for ch in list(self._chans.values()):
            ch.fail(exc)
        self._chans.clear()
        self._hello_event.set()

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._reader.read(1 << 20)
                if not data:
                    self._die(HostError(f"sandbox {self.sandbox_id}: the agent connection closed (VM gone?)",
                                        sandbox_id=self.sandbox_id, reason="eof"))
                    return
                for ftype, chan, payload in self._frames.feed(data):
                    self._dispatch(ftype, chan, payload)
        except (OSError, ValueError) as exc:
            self._die(HostError(f"sandbox {self.sandbox_id}: the agent connection failed: {exc}",
                                sandbox_id=self.sandbox_id, reason=str(exc)))
        except Exception as exc:  # a caller's output callback raised: nothing may hang on this client
            self._die(HostError(f"sandbox {self.sandbox_id}: the agent client failed: {exc!r}",
                                sandbox_id=self.sandbox_id, reason=repr(exc)))
            raise

    def _dispatch(self, ftype: int, chan: int, payload: bytes) -> None:
        if ftype == w.T_HELLO:
            self.last_hello = w.Hello.parse_frame(payload)
            if self._traffic:
                # The agent saw a new connection: it dropped every channel of ours.
                for ch in list(self._chans.values()):
                    ch.fail(HostError(f"sandbox {self.sandbox_id}: the agent reset the connection",
                                      sandbox_id=self.sandbox_id, reason="reset"))
                self._chans.clear()
            self._hello_event.set()
            return
        self._traffic = True
        found = self._chans.get(chan)
        if found is None:
            return  # a channel we gave up on (timeout, cancel)
        ch = found
        if ftype == w.T_ANSWER:
            ans = w.Answer.parse(payload)
            if not ch.answer.done():
                ch.answer.set_result(ans)
            # A pending answer ends a request; streams end on their own frames.
            if not isinstance(ch, _Stream) or ch.ends_on_answer(ans):
                self._chans.pop(chan, None)
            return
        ch.on_frame(ftype, payload)

    def _check(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _new_id(self) -> int:
        while True:
            n = next(self._ids) % (2**32 - 1) + 1
            if n not in self._chans:
                return n

    def _send(self, data: bytes) -> None:
        self._check()
        self._writer.write(data)

    async def _drain(self) -> None:
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            self._die(HostError(f"sandbox {self.sandbox_id}: writing to the agent failed: {exc}",
                                sandbox_id=self.sandbox_id))
            raise self._dead or exc from None

    async def _await_answer(self, ch: _Channel, op: str, timeout: float | None) -> w.Answer:
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(ch.answer)
        except TimeoutError:
            self._chans.pop(ch.chan, None)
            raise HostError(f"sandbox {self.sandbox_id}: the agent did not answer {op} within {timeout:g} s",
                            sandbox_id=self.sandbox_id, op=op) from None

    async def _request(self, req: w.Request, timeout: float | None = ANSWER_TIMEOUT,
                       channel: _Channel | None = None) -> w.Answer:
        chan = channel.chan if channel is not None else self._new_id()
        data = w.request_frame(req, chan)
        self._check()
        ch: _Channel = channel if channel is not None else _Channel(chan)
        self._chans[chan] = ch
        self._send(data)
        await self._drain()
        return await self._await_answer(ch, req.OP, timeout)

    def _ok(self, ans: w.Answer, op: str) -> w.Answer:
        if not ans.ok:
            raise HostError(f"sandbox {self.sandbox_id}: agent {op} failed: {ans.message}",
                            sandbox_id=self.sandbox_id, errno=ans.errno)
        return ans

    def _file_ok(self, ans: w.Answer, op: str, path: str) -> w.Answer:
        if not ans.ok:
            raise file_error(ans.errno, ans.message or errno_mod.errorcode.get(ans.errno, "failed"), path, op,
                             self.sandbox_id)
        return ans

    # ------------------------------------------------------------ basic ops ----

    async def hello(self, timeout: float = 10.0) -> w.Hello:
        """The agent's hello: the H frame it sent on connect, or the answer to a ``hello``
        request (after a template restore the guest sends no H). HostError when the guest
        could not boot its root (``fail``), or on timeout."""
        if self.last_hello is None:
            chan = self._new_id()
            ch = _Channel(chan)
            self._chans[chan] = ch
            self._send(w.request_frame(w.HelloRequest(), chan))
            await self._drain()
            try:
                async with asyncio.timeout(timeout):
                    await _until(ch.answer, self._hello_event)
            except TimeoutError:
                self._chans.pop(chan, None)
                raise HostError(f"sandbox {self.sandbox_id}: no hello from the agent within {timeout:g} s",
                                sandbox_id=self.sandbox_id) from None
            self._check()
            if self.last_hello is None and ch.answer.done():
                self.last_hello = w.Hello.from_fields(self._ok(ch.answer.result(), "hello").fields)
        hello = self.last_hello
        assert hello is not None
        if hello.version != w.AGENT_VERSION:
            raise HostError(f"sandbox {self.sandbox_id}: agent speaks v{hello.version}, not v{w.AGENT_VERSION}",
                            sandbox_id=self.sandbox_id)
        if hello.fail:
            raise HostError(f"sandbox {self.sandbox_id}: the guest could not boot: {hello.fail}",
                            sandbox_id=self.sandbox_id, reason=hello.fail)
        return hello

    async def ping(self, timeout: float = 5.0) -> float:
        """One round trip; its seconds."""
        t0 = time.perf_counter()
        self._ok(await self._request(w.PingRequest(), timeout), "ping")
        return time.perf_counter() - t0

    async def identity(self, hostname: str, machine_id: str, seed: bytes, realtime_ns: int | None = None, *,
                       timeout: float = ANSWER_TIMEOUT) -> None:
        req = w.IdentityRequest(hostname=hostname, machine_id=machine_id, seed=seed, realtime_ns=realtime_ns)
        self._ok(await self._request(req, timeout), "identity")

    async def sync(self, freeze: bool | None = None, *, timeout: float = ANSWER_TIMEOUT) -> None:
        self._ok(await self._request(w.SyncRequest(freeze), timeout), "sync")

    async def netcut(self, allow: Sequence[tuple[str, str, int, int]], *, timeout: float = ANSWER_TIMEOUT) -> int:
        """Destroy the guest's TCP connections the allow-set does not admit; how many."""
        ans = await self._request(w.NetcutRequest(tuple(allow)), timeout)
        self._ok(ans, "netcut")
        return int(ans.fields.get("n", "0"))

    async def poweroff(self, timeout: float = 10.0) -> None:
        self._ok(await self._request(w.PoweroffRequest(), timeout), "poweroff")

    # ------------------------------------------------------------ exec ----

    async def exec(self, argv: Sequence[str], *, env: Sequence[tuple[str, str]] = (), cwd: str = "/",
                   uid: int = 0, gid: int = 0, tty: bool = False, size: tuple[int, int] = (24, 80),
                   stdin: bool = False, window: int = w.DEFAULT_WINDOW,
                   on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
                   timeout: float = ANSWER_TIMEOUT) -> AgentProcess:
        """Start ``argv`` in the sandbox. Output: iterate :meth:`AgentProcess.output`, or
        pass ``on_stdout``/``on_stderr`` (called in the reader task; credit is returned as
        soon as they return). ExecError (with ``errno`` and ``stage``) when it cannot start."""
        req = w.ExecRequest(argv=tuple(argv), env=tuple(env), cwd=cwd, uid=uid, gid=gid, tty=tty, rows=size[0],
                            cols=size[1], stdin=stdin, window=window)
        proc = AgentProcess(self, self._new_id(), window, on_stdout, on_stderr)
        ans = await self._request(req, timeout, channel=proc)
        if not ans.ok:
            self._chans.pop(proc.chan, None)
            raise ExecError(f"sandbox {self.sandbox_id}: cannot run {argv[0]!r}: {ans.message}",
                            sandbox_id=self.sandbox_id, errno=ans.errno, stage=ans.fields.get("stage", ""),
                            argv=list(argv))
        proc.pid = int(ans.fields["pid"])
        return proc

    async def run(self, argv: Sequence[str], *, stdin_data: bytes | None = None, timeout: float | None = None,
                  **kw: object) -> tuple[bytes, bytes, AgentExit]:
        """Run to the end: (stdout, stderr, exit). Convenience for short commands."""
        proc = await self.exec(argv, stdin=stdin_data is not None, **kw)  # type: ignore[arg-type]
        out, err = bytearray(), bytearray()

        async def feed() -> None:
            if stdin_data is not None:
                await proc.write_stdin(stdin_data)
                await proc.close_stdin()

        async with asyncio.timeout(timeout):
            feeder = asyncio.ensure_future(feed())
            try:
                async for fd, data in proc.output():
                    (out if fd == 1 else err).extend(data)
                await feeder
            finally:
                feeder.cancel()
            ex = await proc.wait()
        return bytes(out), bytes(err), ex

    # ------------------------------------------------------------ files ----

    async def stat(self, path: str, *, follow: bool = False, timeout: float = ANSWER_TIMEOUT) -> FileInfo:
        req = w.StatRequest(path, follow)
        ans = self._file_ok(await self._request(req, timeout), "stat", path)
        shown = w.norm_path("path", path)
        return _info(shown, w.Stat.from_fields(shown.rsplit("/", 1)[-1] or "/", ans.fields))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
            return True
        except FileAccessError:
            return False

    async def list(self, path: str = "/", *, timeout: float = ANSWER_TIMEOUT) -> list[FileInfo]:
        req = w.ListRequest(path)
        ch = _ListStream(self._new_id())
        ans = self._file_ok(await self._request(req, timeout, channel=ch), "list", path)
        del ans
        base = w.norm_path("path", path).rstrip("/")
        return sorted((_info(f"{base}/{s.name}", s) for s in ch.entries), key=lambda i: i.name)

    async def read(self, path: str, max_bytes: int = 256 * 1024 * 1024, *, window: int = 1024 * 1024,
                   timeout: float = ANSWER_TIMEOUT) -> bytes:
        """The file's bytes (FileAccessError with EFBIG when over ``max_bytes``). ``timeout``
        bounds each wait for the agent, not the whole transfer."""
        req = w.ReadRequest(path, max_bytes, window)
        ch = _ReadStream(self, self._new_id(), window)
        ans = self._file_ok(await self._request(req, None, channel=ch) if timeout is None
                            else await self._stream_answer(req, ch, timeout), "read", path)
        del ans
        return bytes(ch.data)

    async def _stream_answer(self, req: w.Request, ch: _Stream, timeout: float) -> w.Answer:
        """Send ``req`` and wait for its answer, the timeout restarting whenever a frame arrives."""
        data = w.request_frame(req, ch.chan)
        self._check()
        self._chans[ch.chan] = ch
        self._send(data)
        await self._drain()
        while True:
            seen = ch.frames
            try:
                async with asyncio.timeout(timeout):
                    await _until(ch.answer, ch.progress)
            except TimeoutError:
                pass
            ch.progress.clear()
            if ch.answer.done():
                return ch.answer.result()
            if ch.frames == seen:
                self._chans.pop(ch.chan, None)
                raise HostError(f"sandbox {self.sandbox_id}: the agent stalled on {req.OP} for {timeout:g} s",
                                sandbox_id=self.sandbox_id, op=req.OP)

    async def write(self, path: str, data: bytes, *, mode: int = 0o644, uid: int = 0, gid: int = 0,
                    append: bool = False, timeout: float = ANSWER_TIMEOUT) -> int:
        """Replace (or append to) ``path`` with ``data``; the bytes written."""
        req = w.WriteRequest(path=path, mode=mode, uid=uid, gid=gid, append=append)
        ch = _WriteStream(self, self._new_id())
        frame = w.request_frame(req, ch.chan)
        self._check()
        self._chans[ch.chan] = ch
        self._send(frame)
        view = memoryview(data)
        try:
            async with asyncio.timeout(timeout):
                for off in range(0, len(view), CHUNK):
                    piece = bytes(view[off: off + CHUNK])
                    await ch.room(len(piece))
                    if ch.answer.done():
                        break  # refused early (say, ENOSPC): stop sending
                    ch.in_flight += len(piece)
                    self._send(w.frame(w.T_INPUT, ch.chan, piece))
                    await self._drain()
                if not ch.answer.done():
                    self._send(w.frame(w.T_INPUT, ch.chan, b""))
                    await self._drain()
                ans = await asyncio.shield(ch.answer)
        except TimeoutError:
            self._chans.pop(ch.chan, None)
            raise HostError(f"sandbox {self.sandbox_id}: the agent did not take write {path!r} within {timeout:g} s",
                            sandbox_id=self.sandbox_id, op="write") from None
        return int(self._file_ok(ans, "write", path).fields.get("n", "0"))

    async def mkdir(self, path: str, *, parents: bool = False, mode: int = 0o755, uid: int = 0, gid: int = 0,
                    timeout: float = ANSWER_TIMEOUT) -> None:
        req = w.MkdirRequest(path=path, mode=mode, uid=uid, gid=gid, parents=parents)
        self._file_ok(await self._request(req, timeout), "mkdir", path)

    async def remove(self, path: str, *, recursive: bool = False, timeout: float = ANSWER_TIMEOUT) -> None:
        self._file_ok(await self._request(w.RemoveRequest(path, recursive), timeout), "remove", path)

    async def rename(self, src: str, dst: str, *, timeout: float = ANSWER_TIMEOUT) -> None:
        self._file_ok(await self._request(w.RenameRequest(src, dst), timeout), "rename", f"{src} -> {dst}")


async def _until(fut: asyncio.Future[Any], event: asyncio.Event) -> None:
    """Wait until ``fut`` is done or ``event`` is set."""
    if fut.done() or event.is_set():
        return
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait([fut, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


def _info(path: str, s: w.Stat) -> FileInfo:
    return FileInfo(path=path, name=s.name, type=_KINDS.get(s.kind, "other"), size=s.size,
                    mode=stat_mod.S_IMODE(s.mode), uid=s.uid, gid=s.gid, mtime=s.mtime_ns / 1e9, target=s.target)


# ---------------------------------------------------------------- streams ----


class _Stream(_Channel):
    """A channel that lives past its first answer or frame."""

    def __init__(self, chan: int) -> None:
        super().__init__(chan)
        self.frames = 0
        self.progress = asyncio.Event()

    def ends_on_answer(self, ans: w.Answer) -> bool:
        return True

    def on_frame(self, ftype: int, payload: bytes) -> None:
        self.frames += 1
        self.progress.set()
        self.handle(ftype, payload)

    def handle(self, ftype: int, payload: bytes) -> None:
        pass


class _ListStream(_Stream):
    def __init__(self, chan: int) -> None:
        super().__init__(chan)
        self.entries: list[w.Stat] = []

    def handle(self, ftype: int, payload: bytes) -> None:
        if ftype == w.T_DIRENT:
            self.entries.append(w.Stat.parse_dirent(payload))


class _ReadStream(_Stream):
    def __init__(self, client: AgentClient, chan: int, window: int) -> None:
        super().__init__(chan)
        self.client = client
        self.data = bytearray()
        self.window = window
        self.unacked = 0

    def handle(self, ftype: int, payload: bytes) -> None:
        if ftype != w.T_STDOUT:
            return
        self.data += payload
        self.unacked += len(payload)
        if self.unacked >= self.window // 2 and self.client.alive:
            self.client._send(w.credit(self.chan, self.unacked))
            self.unacked = 0


class _WriteStream(_Stream):
    def __init__(self, client: AgentClient, chan: int) -> None:
        super().__init__(chan)
        self.in_flight = 0
        self.acked = asyncio.Event()

    def handle(self, ftype: int, payload: bytes) -> None:
        if ftype == w.T_INCREDIT:
            self.in_flight = max(0, self.in_flight - w.u32(payload))
            self.acked.set()

    async def room(self, n: int) -> None:
        while self.in_flight + n > w.STDIN_WINDOW and not self.answer.done():
            self.acked.clear()
            await _until(self.answer, self.acked)
        if self.answer.done() and self.answer.exception() is not None:
            raise self.answer.exception()  # type: ignore[misc]


class AgentProcess(_Stream):
    """A running exec. ``pid`` is the guest's pid. Output through :meth:`output` (or the
    callbacks given to exec); :meth:`wait` returns the :data:`AgentExit`."""

    def __init__(self, client: AgentClient, chan: int, window: int, on_stdout: OutputCallback | None,
                 on_stderr: OutputCallback | None) -> None:
        super().__init__(chan)
        self.client = client
        self.pid = 0
        self.window = window
        self._on = {1: on_stdout, 2: on_stderr}
        self._callbacks = on_stdout is not None or on_stderr is not None
        self._queue: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue()
        self._exit: asyncio.Future[AgentExit] = asyncio.get_running_loop().create_future()
        self._unacked = 0
        self._iterating = False
        self._in_flight = 0
        self._acked = asyncio.Event()
        self._stdin_closed = False

    # routed by the client's reader task
    def ends_on_answer(self, ans: w.Answer) -> bool:
        return not ans.ok  # a started exec lives until its X

    def handle(self, ftype: int, payload: bytes) -> None:
        if ftype in (w.T_STDOUT, w.T_STDERR):
            fd = 1 if ftype == w.T_STDOUT else 2
            cb = self._on[fd]
            if self._callbacks:
                if cb is not None:
                    cb(payload)
                self._consumed(len(payload))
            else:
                self._queue.put_nowait((fd, payload))
        elif ftype == w.T_EXIT:
            if not self._exit.done():
                self._exit.set_result(w.Exit.parse(payload))
            self._queue.put_nowait(None)
            self.client._chans.pop(self.chan, None)
        elif ftype == w.T_INCREDIT:
            self._in_flight = max(0, self._in_flight - w.u32(payload))
            self._acked.set()

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        if not self._exit.done():
            self._exit.set_exception(exc)
            self._exit.exception()  # seen: nobody may be waiting
        self._acked.set()
        self._queue.put_nowait(None)

    def _consumed(self, n: int) -> None:
        self._unacked += n
        if self._unacked >= max(1, self.window // 2) and self.client.alive:
            self.client._send(w.credit(self.chan, self._unacked))
            self._unacked = 0

    # the caller's side
    async def output(self) -> AsyncIterator[tuple[int, bytes]]:
        """``(fd, bytes)`` (1 stdout, 2 stderr) until the process has exited and its
        output is all here. Credit goes back to the guest as items are taken."""
        self._iterating = True
        try:
            while True:
                item = await self._queue.get()
                if item is None:
                    self._queue.put_nowait(None)  # for any later reader
                    if self._exit.done() and self._exit.exception() is not None:
                        raise self._exit.exception()  # type: ignore[misc]
                    return
                self._consumed(len(item[1]))
                yield item
        finally:
            self._iterating = False

    async def wait(self, timeout: float | None = None) -> AgentExit:
        """The exit. When nobody takes the output, it is discarded here so the guest does
        not stall on credit."""
        async with asyncio.timeout(timeout):
            while not self._exit.done():
                if self._iterating or self._callbacks:
                    await asyncio.wait([self._exit], return_when=asyncio.FIRST_COMPLETED)
                    continue
                item = await self._queue.get()
                if item is None:
                    self._queue.put_nowait(None)
                    break
                self._consumed(len(item[1]))
            return await self._exit

    async def write_stdin(self, data: bytes) -> None:
        """Send stdin bytes, keeping at most STDIN_WINDOW unacknowledged."""
        view = memoryview(data)
        for off in range(0, len(view), CHUNK):
            piece = bytes(view[off: off + CHUNK])
            while self._in_flight + len(piece) > w.STDIN_WINDOW:
                self.client._check()
                if self._exit.done():
                    return  # the process is gone: nobody reads stdin
                self._acked.clear()
                await _until(self._exit, self._acked)
            if self._exit.done():
                return
            self._in_flight += len(piece)
            self.client._send(w.frame(w.T_INPUT, self.chan, piece))
            await self.client._drain()

    async def close_stdin(self) -> None:
        if self._stdin_closed or self._exit.done():
            return
        self._stdin_closed = True
        self.client._send(w.frame(w.T_INPUT, self.chan, b""))
        await self.client._drain()

    async def signal(self, sig: int, *, tree: bool = True, spare: bool = False,
                     timeout: float = ANSWER_TIMEOUT) -> None:
        """Signal the process (``tree``: every process it started, through its cgroup;
        ``spare``: all of those but the process itself)."""
        ans = await self.client._request(w.SignalRequest(self.chan, sig, tree, spare), timeout)
        if not ans.ok and ans.errno != errno_mod.ESRCH:  # ESRCH: it has exited meanwhile
            raise ExecError(f"sandbox {self.client.sandbox_id}: signal {sig}: {ans.message}",
                            sandbox_id=self.client.sandbox_id, errno=ans.errno)

    async def resize(self, rows: int, cols: int, *, timeout: float = ANSWER_TIMEOUT) -> None:
        ans = await self.client._request(w.ResizeRequest(self.chan, rows, cols), timeout)
        if not ans.ok:
            raise InvalidSpec(f"resize: {ans.message}", field="tty")
