"""envd's Connect services (``process.Process``, ``filesystem.Filesystem``) over DSec's
data path, built on the server classes and messages the released ``e2b`` wheel ships
(``e2b.envd.process.process_connect.ProcessASGIApplication`` and its filesystem twin): the
Connect framing, proto3-JSON and error bodies come out right by construction.

Each call finds its sandbox through ``resolve(headers)`` (front.py: the ``E2b-Sandbox-Id``
header or the access token), then acts with DSec's SDK handle on that one sandbox:
processes are attached commands (rooms.py), files go through the edge's files API, and a
directory watch polls listings (E2B's events: create, write, remove). The user comes from
``Authorization: Basic`` (envd's convention), else the front's default user.

Never blocks the event loop; a stream's tasks end with the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as errno_mod
import logging
import posixpath
import stat as stat_mod
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb as fpb
from e2b.envd.filesystem.filesystem_connect import Filesystem, FilesystemASGIApplication
from e2b.envd.process import process_pb as ppb
from e2b.envd.process.process_connect import Process, ProcessASGIApplication
from protobuf import Oneof
from protobuf.wkt import Timestamp

from dsec.compat.e2b import keys
from dsec.compat.e2b.rooms import Event, Proc, Room, User
from dsec.errors import (
    AuthError,
    Backpressure,
    DsecError,
    ExecTimeout,
    FileAccessError,
    Forbidden,
    InvalidSpec,
    SandboxNotFound,
)

if TYPE_CHECKING:
    from connectrpc.request import Headers, RequestContext

    from dsec.spec.api import FileEntry

log = logging.getLogger("dsec.compat.e2b")

Resolve = Callable[["Headers"], Awaitable[Room]]
KEEPALIVE_S = 50.0
WATCH_POLL_S = 0.25
USER_WRITE_VIA_EXEC = 8 << 20
"""A non-root user's upload up to this size is one exec (``cat`` as that user, so the file is
theirs); a larger one is written by the files API and handed over with ``chown``."""
SIGNALS = {9: "KILL", 15: "TERM"}


def _oneof(name: str, value: Any) -> Any:
    """A oneof member (typed ``Any``: the generated stubs want a literal per field)."""
    return Oneof(name, value)


def not_running(sandbox_id: str) -> str:
    """The message E2B's clients read as "the sandbox is not running" (``was not found``)."""
    return f"The sandbox {sandbox_id} was not found"


def connect_error(exc: BaseException, sandbox_id: str = "") -> ConnectError:
    """One table: a DSec error as the Connect error envd would send."""
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, SandboxNotFound):
        return ConnectError(Code.UNAVAILABLE, not_running(sandbox_id or str(getattr(exc, "sandbox_id", ""))))
    if isinstance(exc, AuthError):
        return ConnectError(Code.UNAUTHENTICATED, exc.message)
    if isinstance(exc, Forbidden):
        return ConnectError(Code.PERMISSION_DENIED, exc.message)
    if isinstance(exc, FileAccessError):
        code = {errno_mod.ENOENT: Code.NOT_FOUND, errno_mod.EEXIST: Code.ALREADY_EXISTS,
                errno_mod.ENOSPC: Code.RESOURCE_EXHAUSTED, errno_mod.EDQUOT: Code.RESOURCE_EXHAUSTED,
                errno_mod.EACCES: Code.PERMISSION_DENIED, errno_mod.EPERM: Code.PERMISSION_DENIED,
                }.get(int(getattr(exc, "errno", 0) or 0), Code.INVALID_ARGUMENT)
        return ConnectError(code, exc.message)
    if isinstance(exc, InvalidSpec):
        return ConnectError(Code.INVALID_ARGUMENT, exc.message)
    if isinstance(exc, Backpressure):
        return ConnectError(Code.RESOURCE_EXHAUSTED, exc.message)
    if isinstance(exc, ExecTimeout):
        return ConnectError(Code.DEADLINE_EXCEEDED, exc.message)
    if isinstance(exc, DsecError):
        return ConnectError(Code.INTERNAL, f"{exc.code}: {exc.message}")
    log.exception("envd call failed", exc_info=exc)
    return ConnectError(Code.INTERNAL, f"internal error: {type(exc).__name__}")


@contextlib.asynccontextmanager
async def _mapped(sandbox_id: str = "") -> AsyncIterator[None]:
    try:
        yield
    except ConnectError:
        raise
    except Exception as exc:
        raise connect_error(exc, sandbox_id) from None


def _keepalive_s(headers: Headers) -> float:
    try:
        return max(1.0, min(KEEPALIVE_S, float(headers.get("keepalive-ping-interval") or KEEPALIVE_S)))
    except ValueError:
        return KEEPALIVE_S


# ------------------------------------------------------------- processes ----


def _end_event(ev: Event) -> ppb.ProcessEvent.EndEvent:
    if ev.exit_code is not None:
        return ppb.ProcessEvent.EndEvent(exit_code=ev.exit_code, exited=True, status=f"exit status {ev.exit_code}",
                                         error=ev.error)
    name = {9: "killed", 15: "terminated", 2: "interrupt", 1: "hangup"}.get(ev.signal or 0, f"signal {ev.signal}")
    return ppb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=f"signal: {name}",
                                     error=ev.error or (None if ev.signal else "the process's connection ended"))


def _proto_event(ev: Event) -> ppb.ProcessEvent:
    if ev.kind == "end":
        return ppb.ProcessEvent(event=_oneof("end", _end_event(ev)))
    return ppb.ProcessEvent(event=_oneof("data", ppb.ProcessEvent.DataEvent(output=_oneof(ev.kind, ev.data))))


def _start_event(pid: int) -> ppb.ProcessEvent:
    return ppb.ProcessEvent(event=_oneof("start", ppb.ProcessEvent.StartEvent(pid=pid)))


async def _events(q: asyncio.Queue[Event], keepalive_s: float) -> AsyncIterator[ppb.ProcessEvent]:
    while True:
        try:
            async with asyncio.timeout(keepalive_s):
                ev = await q.get()
        except TimeoutError:
            yield ppb.ProcessEvent(event=_oneof("keepalive", ppb.ProcessEvent.KeepAlive()))
            continue
        yield _proto_event(ev)
        if ev.kind == "end":
            return


async def _pump(room: Room, proc: Proc) -> None:
    """The process's output to its subscribers, then its end; it leaves the table then."""
    try:
        async for chunk in proc.term.output():
            proc.publish(Event("pty" if proc.tty else chunk.stream, chunk.data))
        ex = proc.term.exit
        if ex is None:
            proc.publish(Event("end", error=f"the connection to sandbox {room.id} ended before the process did"))
        else:
            proc.publish(Event("end", exit_code=ex.exit_code, signal=ex.signal))
    except asyncio.CancelledError:
        proc.publish(Event("end", error="the E2B front is stopping"))
        raise
    except Exception as exc:
        proc.publish(Event("end", error=f"{type(exc).__name__}: {exc}"))
    finally:
        room.procs.pop(proc.pid, None)
        if proc.killer is not None:
            proc.killer.cancel()
        with contextlib.suppress(Exception):
            await proc.term.close()


def _selector(sel: ppb.ProcessSelector | None) -> tuple[int | None, str | None]:
    if sel is None or sel.selector is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "no process selector (pid or tag)")
    if sel.selector.field == "pid":
        return int(sel.selector.value), None
    return None, str(sel.selector.value)


class ProcessService(Process):
    def __init__(self, resolve: Resolve, default_user: str) -> None:
        self._resolve = resolve
        self._default_user = default_user

    async def _room_user(self, ctx: RequestContext[Any, Any]) -> tuple[Room, User]:
        room = await self._resolve(ctx.request_headers)
        user = await room.user(keys.basic_user(ctx.request_headers.get("authorization")), self._default_user)
        return room, user

    async def _proc(self, ctx: RequestContext[Any, Any], sel: ppb.ProcessSelector | None) -> tuple[Room, Proc]:
        room = await self._resolve(ctx.request_headers)
        pid, tag = _selector(sel)
        proc = room.find(pid, tag)
        if proc is None:
            raise ConnectError(Code.NOT_FOUND, f"process with {'pid ' + str(pid) if pid is not None else 'tag ' + repr(tag)} "
                                               "not found")
        return room, proc

    async def start(self, request: ppb.StartRequest, ctx: RequestContext[ppb.StartRequest, ppb.StartResponse]
                    ) -> AsyncIterator[ppb.StartResponse]:
        room = None
        arrived = asyncio.get_running_loop().time()  # envd's deadline runs from the request, not the process
        try:
            room, user = await self._room_user(ctx)
            cfg = request.process
            if cfg is None or not cfg.cmd:
                raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is empty")
            env = await room.env_for(user, dict(cfg.envs))
            cwd = cfg.cwd if cfg.has_field("cwd") and cfg.cwd else user.home
            argv = [cfg.cmd, *cfg.args]
            who = f"{user.uid}:{user.gid}"
            tty = request.pty is not None
            if tty:
                size = request.pty.size if request.pty is not None else None
                rows, cols = (size.rows or 24, size.cols or 80) if size is not None else (24, 80)
                term = await room.handle.pty(argv, rows=rows, cols=cols, env=env, cwd=cwd, user=who)
            else:
                term = await room.handle.attach(argv, env=env, cwd=cwd, user=who)
            if not tty and request.has_field("stdin") and not request.stdin:
                await term.eof()
        except Exception as exc:
            if room is not None and not isinstance(exc, ConnectError | SandboxNotFound | InvalidSpec):
                # the attach's own error may not say why (a refused WebSocket): ask the edge
                try:
                    await room.handle.files.stat("/")
                except SandboxNotFound as gone:
                    exc = gone
                except Exception:
                    pass
            raise connect_error(exc, room.id if room else "") from None
        proc = Proc(pid=term.pid, tag=request.tag if request.has_field("tag") else None, cmd=cfg.cmd,
                    args=list(cfg.args), envs=dict(cfg.envs), cwd=cwd, tty=tty, term=term)
        room.add_proc(proc)
        q = proc.subscribe()
        proc.pump = asyncio.get_running_loop().create_task(_pump(room, proc), name=f"e2b-proc-{room.id}-{proc.pid}")
        timeout_ms = ctx.timeout_ms
        expired: list[asyncio.Future[Any]] = []  # the kill, once the deadline passed

        def expire() -> None:
            expired.append(asyncio.ensure_future(proc.term.signal("KILL")))
            q.put_nowait(Event("end", error="deadline"))  # this stream ends now, the kill goes on beside

        if timeout_ms is not None and timeout_ms > 0:
            # envd ends a process with its request's deadline (Connect-Timeout-Ms: the command's timeout),
            # counted from the request's arrival: the client's own timer must not run out first
            loop = asyncio.get_running_loop()
            proc.killer = loop.call_later(max(0.0, arrived + timeout_ms / 1000.0 - loop.time()), expire)
        try:
            yield ppb.StartResponse(event=_start_event(proc.pid))
            async for ev in _events(q, _keepalive_s(ctx.request_headers)):
                if expired and ev.event is not None and ev.event.field == "end":
                    # as envd: the request's context ended, not the process (clients raise TimeoutException)
                    raise ConnectError(Code.DEADLINE_EXCEEDED, f"the command's timeout ({timeout_ms} ms) passed: "
                                                               "it was killed")
                yield ppb.StartResponse(event=ev)
        finally:
            proc.unsubscribe(q)

    async def connect(self, request: ppb.ConnectRequest, ctx: RequestContext[ppb.ConnectRequest, ppb.ConnectResponse]
                      ) -> AsyncIterator[ppb.ConnectResponse]:
        async with _mapped():
            _, proc = await self._proc(ctx, request.process)
        q = proc.subscribe()
        try:
            yield ppb.ConnectResponse(event=_start_event(proc.pid))
            async for ev in _events(q, _keepalive_s(ctx.request_headers)):
                yield ppb.ConnectResponse(event=ev)
        finally:
            proc.unsubscribe(q)

    async def list(self, request: ppb.ListRequest, ctx: RequestContext[ppb.ListRequest, ppb.ListResponse]
                   ) -> ppb.ListResponse:
        async with _mapped():
            room = await self._resolve(ctx.request_headers)
        return ppb.ListResponse(processes=[
            ppb.ProcessInfo(config=ppb.ProcessConfig(cmd=p.cmd, args=p.args, envs=p.envs, cwd=p.cwd), pid=p.pid,
                            tag=p.tag)
            for p in room.procs.values() if p.ended is None])

    async def send_input(self, request: ppb.SendInputRequest,
                         ctx: RequestContext[ppb.SendInputRequest, ppb.SendInputResponse]) -> ppb.SendInputResponse:
        async with _mapped():
            _, proc = await self._proc(ctx, request.process)
            if request.input is not None and request.input.input is not None:
                await proc.term.send(bytes(request.input.input.value))
        return ppb.SendInputResponse()

    async def stream_input(self, request: AsyncIterator[ppb.StreamInputRequest],
                           ctx: RequestContext[ppb.StreamInputRequest, ppb.StreamInputResponse]
                           ) -> ppb.StreamInputResponse:
        proc: Proc | None = None
        async with _mapped():
            async for msg in request:
                if msg.event is None:
                    continue
                if msg.event.field == "start":
                    _, proc = await self._proc(ctx, msg.event.value.process)
                elif msg.event.field == "data":
                    if proc is None:
                        raise ConnectError(Code.FAILED_PRECONDITION, "input before the start event")
                    data = msg.event.value.input
                    if data is not None and data.input is not None:
                        await proc.term.send(bytes(data.input.value))
        return ppb.StreamInputResponse()

    async def send_signal(self, request: ppb.SendSignalRequest,
                          ctx: RequestContext[ppb.SendSignalRequest, ppb.SendSignalResponse]) -> ppb.SendSignalResponse:
        async with _mapped():
            _, proc = await self._proc(ctx, request.process)
            name = SIGNALS.get(int(request.signal.value) if request.signal is not None else 0)
            if name is None:
                raise ConnectError(Code.INVALID_ARGUMENT, f"signal {request.signal} is not one envd sends (SIGTERM, SIGKILL)")
            await proc.term.signal(name)
        return ppb.SendSignalResponse()

    async def close_stdin(self, request: ppb.CloseStdinRequest,
                          ctx: RequestContext[ppb.CloseStdinRequest, ppb.CloseStdinResponse]) -> ppb.CloseStdinResponse:
        async with _mapped():
            _, proc = await self._proc(ctx, request.process)
            if proc.tty:
                raise ConnectError(Code.FAILED_PRECONDITION, "a PTY has no stdin to close: send Ctrl-D (0x04)")
            await proc.term.eof()
        return ppb.CloseStdinResponse()

    async def update(self, request: ppb.UpdateRequest, ctx: RequestContext[ppb.UpdateRequest, ppb.UpdateResponse]
                     ) -> ppb.UpdateResponse:
        async with _mapped():
            _, proc = await self._proc(ctx, request.process)
            size = request.pty.size if request.pty is not None else None
            if size is not None:
                await proc.term.resize(size.rows or 24, size.cols or 80)
        return ppb.UpdateResponse()


# ------------------------------------------------------------- filesystem ----


def _owner(uid: int) -> str:
    return {0: "root", 1000: "user"}.get(uid, str(uid))


def entry_info(e: FileEntry) -> fpb.EntryInfo:
    kind = {"file": fpb.FileType.FILE, "dir": fpb.FileType.DIRECTORY, "symlink": fpb.FileType.SYMLINK}.get(
        e.type, fpb.FileType.UNSPECIFIED)
    type_bits = {"dir": stat_mod.S_IFDIR, "symlink": stat_mod.S_IFLNK}.get(e.type, stat_mod.S_IFREG)
    return fpb.EntryInfo(
        name=e.name or posixpath.basename(e.path), type=kind, path=e.path, size=e.size, mode=e.mode & 0o7777,
        permissions=stat_mod.filemode(type_bits | (e.mode & 0o7777)), owner=_owner(e.uid), group=_owner(e.gid),
        modified_time=Timestamp.from_datetime(datetime.fromtimestamp(e.mtime, UTC)),
        symlink_target=e.target, is_symlink=e.type == "symlink",
    )


def abs_path(path: str, user: User) -> str:
    """envd's paths: relative ones are under the user's home; ``~`` is the home."""
    if not path:
        raise ConnectError(Code.INVALID_ARGUMENT, "path is empty")
    if path == "~" or path.startswith("~/"):
        path = user.home + path[1:]
    if not path.startswith("/"):
        path = posixpath.join(user.home, path)
    return posixpath.normpath(path)


async def write_as(room: Room, user: User, path: str, data: bytes) -> None:
    """Write ``path`` (parents made, replaced) so that it belongs to ``user``, as envd does."""
    sb = room.handle
    if user.uid == 0:
        await sb.files.write(path, data, parents=True)
        return
    if len(data) <= USER_WRITE_VIA_EXEC:
        res = await sb.exec(["/bin/sh", "-c", 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"', "sh", path],
                            user=f"{user.uid}:{user.gid}", stdin=data, env={"HOME": user.home}, timeout=600)
    else:
        await sb.files.write(path, data, parents=True)
        res = await sb.exec(["chown", f"{user.uid}:{user.gid}", "--", path], timeout=60)
    if res.exit_code != 0:
        msg = (res.stderr_text or res.stdout_text).strip() or f"exit {res.exit_code}"
        no = errno_mod.ENOSPC if "No space" in msg or "quota" in msg.lower() else errno_mod.EACCES
        raise FileAccessError(f"write {path!r} as {user.name} in sandbox {room.id}: {msg}", sandbox_id=room.id,
                              path=path, errno=no)


async def _walk(room: Room, path: str, depth: int) -> list[FileEntry]:
    out: list[FileEntry] = []
    level = [path]
    for _ in range(max(1, depth)):
        nxt: list[str] = []
        for d in level:
            for e in await room.handle.files.list(d):
                out.append(e)
                if e.type == "dir":
                    nxt.append(e.path)
        level = nxt
        if not level:
            break
    return out


class Watch:
    """A polled directory watch: E2B's create / write / remove events from listing diffs."""

    def __init__(self, room: Room, path: str, recursive: bool) -> None:
        self.room = room
        self.path = path
        self.depth = 64 if recursive else 1
        self.seen: dict[str, tuple[str, int, float]] = {}
        self.entries: dict[str, FileEntry] = {}

    async def prime(self) -> None:
        self.seen = await self._snapshot()

    async def _snapshot(self) -> dict[str, tuple[str, int, float]]:
        entries = await _walk(self.room, self.path, self.depth)
        self.entries = {e.path: e for e in entries}
        return {e.path: (e.type, e.size, e.mtime) for e in entries}

    async def poll(self) -> list[fpb.FilesystemEvent]:
        now = await self._snapshot()
        events: list[fpb.FilesystemEvent] = []

        def ev(path: str, kind: fpb.EventType) -> fpb.FilesystemEvent:
            entry = self.entries.get(path)
            return fpb.FilesystemEvent(name=posixpath.relpath(path, self.path), type=kind,
                                       entry=entry_info(entry) if entry is not None else None)

        for p, v in now.items():
            old = self.seen.get(p)
            if old is None:
                events.append(ev(p, fpb.EventType.CREATE))
                if v[0] == "file" and v[1] > 0:
                    events.append(ev(p, fpb.EventType.WRITE))
            elif old != v and v[0] != "dir":
                events.append(ev(p, fpb.EventType.WRITE))
        events.extend(ev(p, fpb.EventType.REMOVE) for p in self.seen if p not in now)
        self.seen = now
        return events


class FilesystemService(Filesystem):
    def __init__(self, resolve: Resolve, default_user: str) -> None:
        self._resolve = resolve
        self._default_user = default_user

    async def _room_user(self, ctx: RequestContext[Any, Any]) -> tuple[Room, User]:
        room = await self._resolve(ctx.request_headers)
        user = await room.user(keys.basic_user(ctx.request_headers.get("authorization")), self._default_user)
        return room, user

    async def stat(self, request: fpb.StatRequest, ctx: RequestContext[fpb.StatRequest, fpb.StatResponse]
                   ) -> fpb.StatResponse:
        async with _mapped():
            room, user = await self._room_user(ctx)
            return fpb.StatResponse(entry=entry_info(await room.handle.files.stat(abs_path(request.path, user))))

    async def make_dir(self, request: fpb.MakeDirRequest, ctx: RequestContext[fpb.MakeDirRequest, fpb.MakeDirResponse]
                       ) -> fpb.MakeDirResponse:
        async with _mapped():
            room, user = await self._room_user(ctx)
            path = abs_path(request.path, user)
            try:
                await room.handle.files.stat(path)
            except FileAccessError as exc:
                if getattr(exc, "errno", None) != errno_mod.ENOENT:
                    raise
            else:
                raise ConnectError(Code.ALREADY_EXISTS, f"directory {path} already exists")
            if user.uid == 0:
                await room.handle.files.mkdir(path, parents=True)
            else:
                res = await room.handle.exec(["mkdir", "-p", "--", path], user=f"{user.uid}:{user.gid}", timeout=60)
                if res.exit_code != 0:
                    raise ConnectError(Code.PERMISSION_DENIED, res.stderr_text.strip() or f"mkdir {path} failed")
            return fpb.MakeDirResponse(entry=entry_info(await room.handle.files.stat(path)))

    async def move(self, request: fpb.MoveRequest, ctx: RequestContext[fpb.MoveRequest, fpb.MoveResponse]
                   ) -> fpb.MoveResponse:
        async with _mapped():
            room, user = await self._room_user(ctx)
            src, dst = abs_path(request.source, user), abs_path(request.destination, user)
            await room.handle.files.rename(src, dst)
            return fpb.MoveResponse(entry=entry_info(await room.handle.files.stat(dst)))

    async def list_dir(self, request: fpb.ListDirRequest, ctx: RequestContext[fpb.ListDirRequest, fpb.ListDirResponse]
                       ) -> fpb.ListDirResponse:
        async with _mapped():
            room, user = await self._room_user(ctx)
            path = abs_path(request.path, user)
            st = await room.handle.files.stat(path)
            if st.type != "dir":
                raise ConnectError(Code.INVALID_ARGUMENT, f"path {path} is not a directory")
            entries = await _walk(room, path, int(request.depth or 1))
            return fpb.ListDirResponse(entries=[entry_info(e) for e in entries])

    async def remove(self, request: fpb.RemoveRequest, ctx: RequestContext[fpb.RemoveRequest, fpb.RemoveResponse]
                     ) -> fpb.RemoveResponse:
        async with _mapped():
            room, user = await self._room_user(ctx)
            await room.handle.files.remove(abs_path(request.path, user), recursive=True)
            return fpb.RemoveResponse()

    async def _watch(self, ctx: RequestContext[Any, Any], path: str, recursive: bool) -> Watch:
        room, user = await self._room_user(ctx)
        full = abs_path(path, user)
        st = await room.handle.files.stat(full)
        if st.type != "dir":
            raise ConnectError(Code.INVALID_ARGUMENT, f"path {full} is not a directory")
        w = Watch(room, full, recursive)
        await w.prime()
        return w

    async def watch_dir(self, request: fpb.WatchDirRequest, ctx: RequestContext[fpb.WatchDirRequest, fpb.WatchDirResponse]
                        ) -> AsyncIterator[fpb.WatchDirResponse]:
        async with _mapped():
            w = await self._watch(ctx, request.path, request.recursive)
        yield fpb.WatchDirResponse(event=_oneof("start", fpb.WatchDirResponse.StartEvent()))
        keepalive = _keepalive_s(ctx.request_headers)
        quiet = 0.0
        while True:
            await asyncio.sleep(WATCH_POLL_S)
            async with _mapped(w.room.id):
                events = await w.poll()
            for e in events:
                yield fpb.WatchDirResponse(event=_oneof("filesystem", e))
            quiet = 0.0 if events else quiet + WATCH_POLL_S
            if quiet >= keepalive:
                quiet = 0.0
                yield fpb.WatchDirResponse(event=_oneof("keepalive", fpb.WatchDirResponse.KeepAlive()))

    async def create_watcher(self, request: fpb.CreateWatcherRequest,
                             ctx: RequestContext[fpb.CreateWatcherRequest, fpb.CreateWatcherResponse]
                             ) -> fpb.CreateWatcherResponse:
        async with _mapped():
            w = await self._watch(ctx, request.path, request.recursive)
        watchers: dict[str, tuple[Watch, list[fpb.FilesystemEvent], asyncio.Task[None]]] = \
            w.room.extras.setdefault("watchers", {})
        wid = uuid.uuid4().hex
        pending: list[fpb.FilesystemEvent] = []

        async def loop() -> None:
            while True:
                await asyncio.sleep(WATCH_POLL_S)
                try:
                    pending.extend(await w.poll())
                except DsecError:
                    return

        task = asyncio.get_running_loop().create_task(loop(), name=f"e2b-watch-{w.room.id}")
        watchers[wid] = (w, pending, task)
        if not w.room.extras.get("watchers_closer"):
            async def close_all() -> None:
                for _, _, t in watchers.values():
                    t.cancel()
                watchers.clear()
            w.room.closers.append(close_all)
            w.room.extras["watchers_closer"] = True
        return fpb.CreateWatcherResponse(watcher_id=wid)

    def _watcher(self, room: Room, wid: str) -> tuple[Watch, list[fpb.FilesystemEvent], asyncio.Task[None]]:
        got = room.extras.get("watchers", {}).get(wid)
        if got is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher {wid} not found")
        return got  # type: ignore[no-any-return]

    async def get_watcher_events(self, request: fpb.GetWatcherEventsRequest,
                                 ctx: RequestContext[fpb.GetWatcherEventsRequest, fpb.GetWatcherEventsResponse]
                                 ) -> fpb.GetWatcherEventsResponse:
        async with _mapped():
            room = await self._resolve(ctx.request_headers)
        _, pending, _ = self._watcher(room, request.watcher_id)
        events = list(pending)
        pending.clear()
        return fpb.GetWatcherEventsResponse(events=events)

    async def remove_watcher(self, request: fpb.RemoveWatcherRequest,
                             ctx: RequestContext[fpb.RemoveWatcherRequest, fpb.RemoveWatcherResponse]
                             ) -> fpb.RemoveWatcherResponse:
        async with _mapped():
            room = await self._resolve(ctx.request_headers)
        _, _, task = self._watcher(room, request.watcher_id)
        task.cancel()
        room.extras["watchers"].pop(request.watcher_id, None)
        return fpb.RemoveWatcherResponse()


def apps(resolve: Resolve, default_user: str) -> dict[str, Any]:
    """Path prefix -> the Connect ASGI app that serves it."""
    return {
        "/process.Process/": ProcessASGIApplication(ProcessService(resolve, default_user)),
        "/filesystem.Filesystem/": FilesystemASGIApplication(FilesystemService(resolve, default_user)),
    }


__all__ = ["FilesystemService", "ProcessService", "apps", "connect_error", "entry_info", "not_running"]
