"""One warm worker as the host sees it: its sandbox, the program in it, the frames to and from
it, and a worker's answer turned into an :class:`FnResult` or a typed :class:`FnCallFailed`.
The pool (:mod:`pool`) keeps the workers of each image and picks one per call."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from dsec.backends.fncall.config import FnCallImage
from dsec.errors import ImageError, InvalidSpec
from dsec.spec import ImageRef, SandboxSpec
from dsec.spec.fncall import (
    FnCallError,
    FnCallOOM,
    FnCallOutputTooLarge,
    FnCallTimeout,
    FnCallWorkerLost,
    FnOutcome,
    FnResult,
)

if TYPE_CHECKING:
    from dsec.backends.fncall.pool import FnCallPool

log = logging.getLogger("dsec.fncall")

PROGRAM: Final = Path(__file__).with_name("worker.py")
PROGRAM_PATH: Final = "/opt/dsec-fncall/worker.py"
"""Where the worker program lives inside a worker sandbox (root-owned, read-only to calls)."""
LABEL: Final = "dsec.fncall"
"""Label of every worker sandbox (value ``worker``): the edge does not list them to users."""
LABEL_POOL: Final = "dsec.fncall.pool"
CALL_ENV: Final = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    # One thread per numerical library: a call is one core's worth of work, and a
    # template with BLAS threads would fork into a call with none of them.
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}
WORKER_NET_SYSCTLS: Final = {"net.ipv4.tcp_max_tw_buckets": "0"}
"""Of each worker sandbox's network namespace (its loopback, shared by its calls)."""
_U32 = struct.Struct(">I")
_MAX_FRAME: Final = (1 << 30) + (1 << 20)
"""A frame from a worker longer than this is a broken worker (its own cap is 1 GiB)."""
_RESTART_BACKOFF_S: Final = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class WorkerHost(Protocol):
    """What the pool needs of the backend its worker sandboxes live in (the container backend)."""

    @property
    def sandboxes(self) -> Mapping[str, Any]: ...

    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None, hide_pids: bool = False) -> Any: ...

    async def destroy(self, sandbox_id: str) -> bool: ...

    async def start_process(self, sandbox_id: str, argv: Sequence[str], *, stdin: int, stdout: int, stderr: int,
                            env: Mapping[str, str] | None = None, cwd: str = "/", user: int | str = 0) -> Any: ...

    def files(self, sandbox_id: str) -> Any: ...

    def child_cgroups(self, sandbox_id: str, controller: str, names: Sequence[str]) -> list[Path]: ...

    def set_net_sysctls(self, sandbox_id: str, values: Mapping[str, str]) -> None: ...


def image_ref(image: ImageRef | str) -> ImageRef:
    """An image as a call names it: an :class:`ImageRef`, or a base layer reference ``NAME[:TAG]``."""
    if isinstance(image, ImageRef):
        return image
    try:
        return ImageRef(base=image)
    except ValueError as exc:
        raise InvalidSpec(f"image {image!r}: {exc}", field="image") from None


def image_label(image: ImageRef) -> str:
    parts = [image.base, *([image.workspace] if image.workspace else []), *image.toolkits]
    return "+".join(parts)


@dataclass(slots=True)
class _Limits:
    timeout: float | None
    memory: int
    output_cap: int


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[tuple[dict[str, Any], bytes]]
    started: float


class _Frames(asyncio.Protocol):
    """A worker's stdout: frames parsed as the bytes arrive and handed to the worker (no reader
    task: one wake-up of the loop per read, not one per ``readexactly``)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.buf = bytearray()
        self.why = "its supervisor exited"

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        try:
            while len(buf) >= 8:
                total = _U32.unpack_from(buf, 0)[0]
                if total > _MAX_FRAME or total < 4:
                    raise ValueError(f"a frame of {total} bytes")
                if len(buf) < 4 + total:
                    return
                hlen = _U32.unpack_from(buf, 4)[0]
                header = json.loads(buf[8 : 8 + hlen])
                payload = bytes(buf[8 + hlen : 4 + total])
                del buf[: 4 + total]
                self.worker._on_frame(header, payload)
                if header.get("op") == "fatal":
                    self.why = f"it gave up: {header.get('error')} {header.get('detail') or ''}".strip()
        except Exception as exc:  # a malformed frame: the worker cannot be trusted any more
            self.why = f"bad frame from the worker: {exc!r}"
            self.worker._lost(self.why)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.worker._lost(self.why)


class Worker:
    """One worker sandbox: its supervisor process and the calls in flight on it."""

    def __init__(self, pool: FnCallPool, image: ImageRef, cfg: FnCallImage, index: int) -> None:
        self.pool = pool
        self.image = image
        self.cfg = cfg
        self.index = index
        self.sandbox_id: str | None = None
        self.state = "new"  # new -> starting -> ready -> dead
        self.capacity = cfg.concurrency
        self.in_flight = 0
        self.pending: dict[int, _Pending] = {}
        self.info: dict[str, Any] = {}
        self.reason = ""
        self.started_at = 0.0
        self.calls = 0
        self._proc: Any = None
        self._writer: asyncio.StreamWriter | None = None
        self._frames: asyncio.ReadTransport | None = None
        self._stderr_task: asyncio.Task[None] | None = None
        self._stderr: collections.deque[str] = collections.deque(maxlen=200)
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._ids = 0

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def supervisor_pid(self) -> int | None:
        """The worker program's host pid (None before it runs)."""
        return None if self._proc is None else int(self._proc.pid)

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr)

    # -- start / stop --

    async def start(self) -> None:
        host = self.pool.host
        cfg = self.pool.config
        self.state = "starting"
        self.started_at = time.monotonic()
        spec = SandboxSpec(image=self.image, resources=self.cfg.resources,
                           labels={LABEL: "worker", LABEL_POOL: self.pool.name})
        # hide_pids: a call sees in /proc only its own uid's processes (not another call's
        # command lines); the supervisor and zygote, root, see all.
        rec = await host.create(spec, hide_pids=True)
        self.sandbox_id = str(rec.id)
        program = await asyncio.to_thread(PROGRAM.read_bytes)
        await asyncio.to_thread(host.files(self.sandbox_id).write, PROGRAM_PATH, program, mode=0o644,
                                make_parents=True)
        slots = self.cfg.concurrency + self.cfg.spare
        # Calls share the worker's loopback: a connection a call closed would stay in TIME_WAIT
        # in /proc/net/tcp for a minute, readable by the calls after it (a channel across
        # time). None is kept: both ends of a loopback connection close together anyway.
        await asyncio.to_thread(host.set_net_sysctls, self.sandbox_id, WORKER_NET_SYSCTLS)
        cg_fds, cg_hello = await asyncio.to_thread(self._slot_cgroups, self.sandbox_id, slots)
        # The supervisor's stdin is a socket: the slots' cgroup files travel over it as fds.
        to_host, to_worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            try:
                self._proc = await host.start_process(
                    self.sandbox_id, [self.cfg.python, "-I", PROGRAM_PATH, "supervise"], stdin=to_worker.fileno(),
                    stdout=out_w, stderr=err_w, env={"PYTHONDONTWRITEBYTECODE": "1"}, cwd="/", user=0)
            except BaseException:
                to_host.close()
                for fd in (out_r, err_r):
                    os.close(fd)
                raise
            finally:
                to_worker.close()
                for fd in (out_w, err_w):
                    os.close(fd)
            for i in range(0, len(cg_fds), 240):  # SCM_RIGHTS carries at most 253 fds a message
                chunk = cg_fds[i : i + 240]
                socket.send_fds(to_host, [_frame({"op": "fds", "n": len(chunk)})], chunk)
        finally:
            for fd in cg_fds:
                os.close(fd)
        loop = asyncio.get_running_loop()
        self._frames, _ = await loop.connect_read_pipe(lambda: _Frames(self), open(out_r, "rb", buffering=0))  # noqa: SIM115 - the transport owns and closes it
        err_reader = asyncio.StreamReader(limit=1 << 20)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(err_reader),
                                     open(err_r, "rb", buffering=0))  # noqa: SIM115 - the transport owns and closes it
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, to_host)
        self._writer = asyncio.StreamWriter(transport, protocol, None, loop)
        self._ready = loop.create_future()
        self._stderr_task = asyncio.create_task(self._read_stderr(err_reader))
        await self._send({
            "op": "hello", "preload": list(self.cfg.preload), "slots": slots, "uid_base": cfg.call_uid_base,
            "env": CALL_ENV, "cgroup": cg_hello,
            "limits": {"nproc": cfg.call_processes, "fsize": cfg.call_file_size, "nofile": cfg.call_nofile},
        })
        try:
            self.info = await asyncio.wait_for(asyncio.shield(self._ready), cfg.start_timeout_s)
        except TimeoutError:
            raise ImageError(f"fncall worker for {image_label(self.image)} not ready within "
                             f"{cfg.start_timeout_s} s; its log: {self.stderr_tail()[-2000:]}",
                             image=image_label(self.image)) from None
        self.state = "ready"
        log.info("fncall worker %s for %s ready in %.2f s (python %s, preload %.2f s, lockdown %.2f s)",
                 self.sandbox_id, image_label(self.image), time.monotonic() - self.started_at,
                 self.info.get("python"), self.info.get("preload_s", 0.0), self.info.get("lockdown_s", 0.0))

    def _slot_cgroups(self, sandbox_id: str, slots: int) -> tuple[list[int], dict[str, Any] | None]:
        """A memory cgroup per slot below the worker sandbox's (blocking: run in a thread), and
        its files opened for the supervisor: ``cgroup.procs`` (a call process joins it before
        it drops to its uid), ``memory.limit_in_bytes`` and, with swap accounting,
        ``memory.memsw.limit_in_bytes`` (set per call to its ``memory``). Returns the fds, slot
        by slot, and what the hello frame says of them."""
        limit = self.pool.config.call_memory
        dirs = self.pool.host.child_cgroups(sandbox_id, "memory", [f"fncall-slot-{i}" for i in range(slots)])
        files = ["cgroup.procs", "memory.limit_in_bytes"]
        if (dirs[0] / "memory.memsw.limit_in_bytes").exists():
            files.append("memory.memsw.limit_in_bytes")
        files.append("memory.usage_in_bytes")
        fds: list[int] = []
        try:
            for d in dirs:
                for name in files[1:-1]:  # memory first: memory <= memory+swap at every step
                    (d / name).write_text(str(limit))
                fds += [os.open(d / name, (os.O_RDONLY if name.startswith("memory.usage") else os.O_WRONLY)
                                | os.O_CLOEXEC) for name in files]
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            raise ImageError(f"cannot set up the memory cgroups of fncall worker {sandbox_id}: {exc}",
                             image=image_label(self.image)) from exc
        return fds, {"files": files, "limit": limit}

    async def stop(self, reason: str) -> None:
        """Fail what is in flight, stop reading, destroy the sandbox. Idempotent."""
        self._die(reason)
        if self._frames is not None:
            self._frames.close()
            self._frames = None
        task = self._stderr_task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._proc is not None:
            with contextlib.suppress(Exception):
                self._proc.kill()
        if self.sandbox_id is not None:
            sid, self.sandbox_id = self.sandbox_id, None
            try:
                await self.pool.host.destroy(sid)
            except Exception:
                log.exception("fncall: destroying worker sandbox %s failed", sid)

    def _die(self, reason: str) -> None:
        if self.state == "dead":
            return
        was = self.state
        self.state = "dead"
        self.reason = reason
        err = FnCallWorkerLost(f"fncall worker {self.sandbox_id} for {image_label(self.image)} was lost: {reason}",
                               worker=self.sandbox_id or "", reason=reason)
        for p in self.pending.values():
            if not p.future.done():
                p.future.set_exception(err)
        self.pending.clear()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ImageError(
                f"fncall worker for {image_label(self.image)} failed to start: {reason}",
                image=image_label(self.image)))
            self._ready.exception()  # retrieved: start() may already have given up on it
        if was == "ready":
            self.pool._worker_died(self)

    # -- frames --

    async def _send(self, header: Mapping[str, Any], payload: bytes = b"") -> None:
        if self._writer is None:
            raise FnCallWorkerLost(f"fncall worker {self.sandbox_id} is gone", worker=self.sandbox_id or "",
                                   reason=self.reason or "stopped")
        self._writer.write(_frame(header, payload))
        await self._writer.drain()

    def _lost(self, why: str) -> None:
        """The channel from the supervisor closed or carried garbage: the worker is gone."""
        if self.state == "dead":
            return
        # Callers get the reason; the worker's log (tracebacks, scratch paths: what one call
        # did) stays with the operator.
        log.warning("fncall worker %s for %s lost: %s; its log:\n%s", self.sandbox_id, image_label(self.image), why,
                    self.stderr_tail()[-4000:])
        self._die(why)
        if self._frames is not None:
            self._frames.close()

    async def _read_stderr(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(asyncio.CancelledError, ValueError):
            while line := await reader.readline():
                text = line.decode("utf-8", "replace").rstrip()
                self._stderr.append(text)
                log.debug("fncall worker %s: %s", self.sandbox_id, text)

    def _on_frame(self, header: dict[str, Any], payload: bytes) -> None:
        op = header.get("op")
        if op == "result":
            p = self.pending.pop(int(header["id"]), None)
            if p is not None and not p.future.done():
                # stdout and stderr are raw bytes at the head of the payload (worker.py, respond)
                n_out, n_err = int(header.get("out", 0)), int(header.get("err", 0))
                view = memoryview(payload)
                header["stdout"] = str(view[:n_out], "utf-8", "replace")
                header["stderr"] = str(view[n_out : n_out + n_err], "utf-8", "replace")
                p.future.set_result((header, bytes(view[n_out + n_err :])))
        elif op == "ready":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(header)
        elif op == "fatal":
            log.error("fncall worker %s gave up: %s %s", self.sandbox_id, header.get("error"), header.get("detail"))
        elif op == "pong":
            pass

    # -- calls --

    async def call(self, payload: bytes, limits: _Limits) -> tuple[dict[str, Any], bytes, float]:
        """Send one call; its answer header and payload, and when it was sent."""
        if self.state != "ready":
            raise FnCallWorkerLost(f"fncall worker {self.sandbox_id} is {self.state}", worker=self.sandbox_id or "",
                                   reason=self.reason or self.state)
        self._ids += 1
        cid = self._ids
        fut: asyncio.Future[tuple[dict[str, Any], bytes]] = asyncio.get_running_loop().create_future()
        started = time.monotonic()
        self.pending[cid] = _Pending(fut, started)
        self.calls += 1
        try:
            await self._send({"op": "call", "id": cid, "timeout": limits.timeout, "memory": limits.memory,
                              "output_cap": limits.output_cap}, payload)
            if limits.timeout is None:
                header, body = await fut
            else:
                # A timer on the future itself, not wait_for(shield(...)): two futures, a task
                # and their callbacks fewer per call.
                guard = limits.timeout + self.pool.config.answer_grace_s
                timer = asyncio.get_running_loop().call_later(guard, _expire, fut)
                try:
                    header, body = await fut
                except TimeoutError:
                    sid = self.sandbox_id or ""  # stop() clears it
                    await self.stop(f"no answer {guard:.1f} s after a call was sent")
                    raise FnCallWorkerLost(f"fncall worker {sid} did not answer a call within {guard:.1f} s",
                                           reason="unresponsive", worker=sid) from None
                finally:
                    timer.cancel()
        except asyncio.CancelledError:
            if self.pending.pop(cid, None) is not None and self.state == "ready":
                with contextlib.suppress(Exception):  # kill it in the worker: nobody waits for it
                    await asyncio.shield(self._send({"op": "cancel", "id": cid}))
            raise
        return header, body, started


def _frame(header: Mapping[str, Any], payload: bytes = b"") -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    return _U32.pack(4 + len(h) + len(payload)) + _U32.pack(len(h)) + h + payload


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


def _labels(rec: Any) -> dict[str, str]:
    spec = getattr(rec, "spec", None)
    return dict(getattr(spec, "labels", None) or {})


def _outcome(h: Mapping[str, Any], body: bytes, limits: _Limits, worker: str, duration: float) -> FnOutcome:
    """A worker's answer as the caller's outcome. Total: the payload is the call's own bytes
    (a call can forge its result frame), so anything malformed in it is that call's
    ``ProtocolError``, never an exception out of here (which would fail a whole batch)."""
    common: dict[str, Any] = {"stdout": str(h.get("stdout", "")), "stderr": str(h.get("stderr", "")),
                              "worker": worker, "duration_s": round(duration, 6)}
    try:
        return _outcome_of(h, body, limits, common)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        return FnCallError(f"the call's result could not be read: {type(exc).__name__}", exc_type="ProtocolError",
                           exc_message="bad result", traceback="", **common)


def _outcome_of(h: Mapping[str, Any], body: bytes, limits: _Limits, common: dict[str, Any]) -> FnOutcome:
    kind = h.get("kind")
    if kind == "value":
        try:
            value = json.loads(body)
        except ValueError:
            return FnCallError("the call's result could not be decoded", exc_type="ProtocolError",
                               exc_message="bad result", traceback="", **common)
        return FnResult(value=value, run_s=float(h.get("run_s", 0.0)), **common)
    if kind == "error":
        d: Any = None
        with contextlib.suppress(ValueError):
            d = json.loads(body)
        if not isinstance(d, dict):
            return FnCallError("the call wrote an error result that is not a JSON object", exc_type="ProtocolError",
                               exc_message="bad error result", traceback="", **common)
        exc_type, msg = str(d.get("exc_type", "Error")), str(d.get("message", ""))
        return FnCallError(f"{exc_type}: {msg}" if msg else exc_type, exc_type=exc_type, exc_message=msg,
                           traceback=str(d.get("traceback", "")), **common)
    if kind == "timeout":
        if h.get("queued"):
            return FnCallTimeout(f"the call waited {limits.timeout} s for a free slot on its worker and did not run",
                                 timeout=limits.timeout, reason="queued", **common)
        return FnCallTimeout(f"the call ran longer than {limits.timeout} s and was killed with every process it "
                             "started", timeout=limits.timeout, reason="timeout", **common)
    if kind == "oom":
        how = ("was killed by the kernel: it ran out of memory" if h.get("signal")
               else f"could not be limited to its {limits.memory} bytes of memory" if h.get("detail")
               else f"ran out of its {limits.memory} bytes of memory (MemoryError)")
        return FnCallOOM(f"the call {how}", memory=limits.memory, **common)
    if kind == "output":
        what = str(h.get("what", "output"))
        return FnCallOutputTooLarge(f"the call's {what} went past its output cap of {limits.output_cap} bytes"
                                    + ("; it was killed there" if what != "result" else ""),
                                    what=what, output_cap=limits.output_cap, **common)
    if kind == "crash":
        if h.get("signal") is not None:
            import signal as _signal

            try:
                name = _signal.Signals(int(h["signal"])).name
            except ValueError:
                name = f"signal {h['signal']}"
            return FnCallError(f"the call's process was killed by {name}", exc_type="Signal", exc_message=name,
                               signal=int(h["signal"]), traceback="", **common)
        code = h.get("exit_code")
        return FnCallError(f"the call's process exited with status {code} without returning", exc_type="ProcessExit",
                           exc_message=f"exit status {code}", exit_code=code, traceback="", **common)
    return FnCallError(f"unknown answer {kind!r} from the worker", exc_type="ProtocolError", exc_message=str(kind),
                       traceback="", **common)
