"""E2B's code-interpreter plane (port 49999): ``POST /execute`` and ``/contexts``.

A context is one IPython kernel in the sandbox, driven by ``kernel_server.py`` (an attached
command: requests on its stdin, E2B's execution messages on its stdout), itself started
with SandboxFusion's kernel machinery (``compat/sandboxfusion/jupyter_driver.py``, written
beside it). The default context (``context_id`` left out) starts on the first cell. Cells of
one context run one at a time, in order; state persists within a context.

Answers: NDJSON, one message a line, flushed as each comes (``stdout``, ``stderr``,
``result``, ``error``, ``number_of_executions``, ``end_of_execution``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from dsec.errors import DsecError, SandboxNotFound

if TYPE_CHECKING:
    from dsec.compat.e2b.rooms import Room, Rooms
    from dsec.sdk.terminal import AsyncTerminal

HELPERS = "/opt/dsec-compat"
MARK = b"\x1edsec-e2b "
KERNEL_START_S = 90.0


@dataclass
class Context:
    id: str
    language: str
    cwd: str
    term: AsyncTerminal
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    reader: asyncio.Task[None] | None = None

    def json(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


async def _read(ctx: Context) -> None:
    buf = b""
    try:
        async for chunk in ctx.term.output():
            buf += chunk.data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                i = line.find(MARK)
                if i >= 0:
                    with contextlib.suppress(ValueError):
                        ctx.queue.put_nowait(json.loads(line[i + len(MARK):]))
    finally:
        ctx.queue.put_nowait(None)


def _program(name: str) -> bytes:
    pkg = "dsec.compat.sandboxfusion" if name == "jupyter_driver.py" else "dsec.compat.e2b"
    return resources.files(pkg).joinpath(name).read_bytes()


class Interpreter:
    def __init__(self, rooms: Rooms) -> None:
        self.rooms = rooms

    def _contexts(self, room: Room) -> dict[str, Context]:
        got: dict[str, Context] | None = room.extras.get("contexts")
        if got is None:
            got = {}
            room.extras["contexts"] = got

            async def close() -> None:
                for c in list(got.values()):
                    await _stop(c)
                got.clear()
            room.closers.append(close)
        return got

    async def _start(self, room: Room, language: str, cwd: str, ctx_id: str) -> Context:
        if not room.extras.get("kernel_programs"):
            for name in ("jupyter_driver.py", "kernel_server.py"):
                await room.handle.files.write(f"{HELPERS}/{name}", _program(name), parents=True)
            room.extras["kernel_programs"] = True
        user = await room.user("user", "user")
        env = await room.env_for(user, {})
        term = await room.handle.attach(["python3", f"{HELPERS}/kernel_server.py", cwd], env=env, cwd=cwd,
                                        user=f"{user.uid}:{user.gid}")
        ctx = Context(ctx_id, language, cwd, term)
        ctx.reader = asyncio.get_running_loop().create_task(_read(ctx), name=f"e2b-kernel-{room.id}-{ctx_id}")
        try:
            async with asyncio.timeout(KERNEL_START_S):
                first = await ctx.queue.get()
        except TimeoutError:
            first = {"type": "fatal", "message": f"the kernel did not start within {KERNEL_START_S:g} s"}
        if first is None or first.get("type") != "ready":
            await _stop(ctx)
            why = (first or {}).get("message") or "the kernel server ended (is python3 with ipykernel in the image? " \
                                                  "template code-interpreter-v1 has it)"
            raise DsecError(f"sandbox {room.id}: {why}")
        return ctx

    async def _context(self, room: Room, ctx_id: str | None) -> Context:
        contexts = self._contexts(room)
        key = ctx_id or "default"
        ctx = contexts.get(key)
        if ctx is None:
            if ctx_id is not None:
                raise LookupError(f"context {ctx_id} not found")
            lock = room.extras.setdefault("default_lock", asyncio.Lock())
            async with lock:
                ctx = contexts.get(key)
                if ctx is None:
                    ctx = await self._start(room, "python", "/home/user", key)
                    contexts[key] = ctx
        return ctx

    async def serve(self, room: Room, scope: dict[str, Any], receive: Any, send: Any) -> None:
        request = Request(scope, receive)
        path, method = scope.get("path", ""), scope["method"]
        try:
            if path == "/execute" and method == "POST":
                resp = await self.execute(room, request)
            elif path == "/contexts" and method == "POST":
                body = await _body(request)
                lang = body.get("language") or "python"
                if lang != "python":
                    return await _err(400, f"language {lang!r} is not served (python is)")(scope, receive, send)
                cid = uuid.uuid4().hex
                ctx = await self._start(room, lang, body.get("cwd") or "/home/user", cid)
                self._contexts(room)[cid] = ctx
                resp = JSONResponse(ctx.json())
            elif path == "/contexts" and method == "GET":
                resp = JSONResponse([c.json() for c in self._contexts(room).values()])
            elif path.startswith("/contexts/") and method == "DELETE":
                gone = self._contexts(room).pop(path.split("/")[2], None)
                if gone is None:
                    resp = _err(404, f"context {path.split('/')[2]} not found")
                else:
                    await _stop(gone)
                    resp = Response(status_code=204)
            elif path.startswith("/contexts/") and path.endswith("/restart") and method == "POST":
                cid = path.split("/")[2]
                contexts = self._contexts(room)
                old = contexts.get(cid)
                if old is None:
                    resp = _err(404, f"context {cid} not found")
                else:
                    await _stop(old)
                    contexts[cid] = await self._start(room, old.language, old.cwd, cid)
                    resp = Response(status_code=204)
            else:
                resp = _err(404, f"no code-interpreter route {method} {path}")
        except LookupError as exc:
            resp = _err(404, str(exc.args[0] if exc.args else exc))
        except SandboxNotFound:
            resp = _err(502, f"The sandbox {room.id} was not found")
        except DsecError as exc:
            resp = _err(500, exc.message)
        await resp(scope, receive, send)

    async def execute(self, room: Room, request: Request) -> Response:
        body = await _body(request)
        code = body.get("code")
        if not isinstance(code, str):
            return _err(400, "code must be a string")
        lang = body.get("language") or "python"
        if lang != "python":
            return _err(400, f"language {lang!r} is not served (python is)")
        ctx = await self._context(room, body.get("context_id"))
        env_vars = body.get("env_vars") or {}

        async def lines() -> AsyncIterator[bytes]:
            async with ctx.lock:
                await ctx.term.send(json.dumps({"code": code, "env_vars": env_vars}).encode() + b"\n")
                while True:
                    msg = await ctx.queue.get()
                    if msg is None:
                        yield json.dumps({"type": "error", "name": "KernelDied", "value": "the kernel ended",
                                          "traceback": ""}).encode() + b"\n"
                        self._contexts(room).pop(ctx.id, None)
                        return
                    yield json.dumps(msg).encode() + b"\n"
                    if msg.get("type") == "end_of_execution":
                        return

        return StreamingResponse(lines(), media_type="application/x-ndjson")


async def _stop(ctx: Context) -> None:
    with contextlib.suppress(Exception):
        await ctx.term.eof()
    with contextlib.suppress(Exception):
        await ctx.term.close()
    if ctx.reader is not None:
        ctx.reader.cancel()
        with contextlib.suppress(BaseException):
            await ctx.reader


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise LookupError("the body must be a JSON object")
    return body


def _err(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)
