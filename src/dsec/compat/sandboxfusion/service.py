"""SandboxFusion's ``run_code`` and ``run_jupyter``, each call in a fresh DSec sandbox.

One request = one sandbox of the language's toolchain image (languages.py): create it,
write the code, the request's files and any helper in one go, run the compile stage and
then the run stage as separate commands under their own time limits, read back
``fetch_files``, answer, and delete the sandbox in the background (its slot in the window
is given back once the delete is done, so the window tracks what the cluster holds). The
code never runs on the server: only in the sandbox, with its namespaces, seccomp filter,
cgroup limits and no network.

This is an SDK client of the control plane it is served by (``dsec.AsyncClient`` with
the caller's own token): creates count against the caller's project quota and go through
placement and edge admission like any other; exec and file traffic goes to the edge
directly. Refusals (``Backpressure``, ``QuotaExceeded``) are absorbed by a
:class:`~dsec.compat.window.Window` and answered only when waiting passes
``queue_timeout_s`` (:class:`Busy`: the route answers 504, which verl and the
sandbox-fusion client retry). Everything else that goes wrong is a ``SandboxError``
answer with a message, as SandboxFusion's own server does.

Never blocks the event loop; never leaves a sandbox behind (a TTL backs the delete up).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import io
import json
import logging
import posixpath
import tarfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from dsec.compat.sandboxfusion import languages
from dsec.compat.sandboxfusion.config import SandboxFusionConfig
from dsec.compat.sandboxfusion.helpers import helper
from dsec.compat.sandboxfusion.jupyter_driver import MARK as JUPYTER_MARK
from dsec.compat.sandboxfusion.models import (
    CellRunResult,
    CommandRunResult,
    CommandRunStatus,
    RunCodeRequest,
    RunCodeResponse,
    RunJupyterRequest,
    RunJupyterResponse,
    RunStatus,
    run_status,
)
from dsec.compat.window import Window, WindowTimeout
from dsec.errors import (
    Backpressure,
    DsecError,
    ExecTimeout,
    ImageError,
    InvalidSpec,
    QuotaExceeded,
    SandboxNotFound,
)

if TYPE_CHECKING:
    from dsec.sdk.client import AsyncClient, AsyncSandbox
    from dsec.spec import SandboxSpec
    from dsec.spec.results import ExecResult

log = logging.getLogger("dsec.compat.sandboxfusion")

MiB = 1024 * 1024
LABELS = {"dsec.compat": "sandboxfusion"}
TTL_MARGIN_S = 120.0
"""A request's sandbox lives at most its time limits plus this (the delete's backstop)."""
JUPYTER_START_S = 60.0
"""Allowed on top of ``total_timeout`` for the kernel to start."""
MAX_CLIENTS = 16
DELETE_WAIT_S = 30.0
R = TypeVar("R", RunCodeResponse, RunJupyterResponse)
JUPYTER_OUTPUT_CAP = 32 * MiB
"""The driver's stdout carries every cell's output (plots as base64 PNG): more room than a stage."""
CLIENT_SLACK_S = 10.0
"""What verl's client (and the sandbox-fusion client) add to a request's compile and run
timeouts for its own HTTP timeout."""
QUEUE_FLOOR_S = 10.0
"""The least a request waits for a sandbox before its 504 (``queue_timeout_s`` unset)."""
QUEUE_MARGIN_S = 2.0
"""Kept of that slack for the sandbox's create, the answer and the client's clock."""


class Busy(Exception):
    """No room for the request's sandbox within ``queue_timeout_s``: answer 504."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _Failed(Exception):
    """The request cannot run: answered ``SandboxError`` with this message."""


class SandboxFusion:
    def __init__(self, config: SandboxFusionConfig) -> None:
        self.config = config
        self.window = Window(config.ceiling, max_waiting=config.max_waiting, hold_s=config.retry_hold_s)
        self._clients: OrderedDict[tuple[str, str], AsyncClient] = OrderedDict()
        self._deletes: set[asyncio.Task[None]] = set()
        self._closed = False
        self.served = 0
        self.sandbox_errors = 0
        self.busy = 0
        self.unavailable = 0

    # ------------------------------------------------------------ requests ----

    async def run_code(self, control_url: str, token: str, req: RunCodeRequest) -> RunCodeResponse:
        recipe = languages.RECIPES.get(req.language)
        if recipe is None:
            if req.language in languages.UNAVAILABLE:
                return self._unavailable(req.language)
            served = ", ".join(languages.RECIPES)
            return self._error(RunCodeResponse, f"language {req.language!r} is not served by DSec (it serves {served})")
        self._check_timeouts(req.compile_timeout, req.run_timeout)
        try:
            files = _decode_files(req.files)
            plan = languages.plan(recipe, req.code, list(files))
        except languages.PlanError as exc:  # as SandboxFusion: a compile stage in Error, so SandboxError
            stage = CommandRunResult(status=CommandRunStatus.Error, return_code=1, stderr=str(exc))
            status, message = run_status(stage, None)
            return RunCodeResponse(status=status, message=message, compile_result=stage)
        except _Failed as exc:
            return self._error(RunCodeResponse, str(exc))
        spec = self._spec(recipe.toolchain, req.memory_limit_MB)
        ttl = req.compile_timeout + req.run_timeout + TTL_MARGIN_S
        compile_cmd, run_cmd = plan.compile, plan.run
        try:
            async with self._sandbox(control_url, token, spec, ttl, recipe.toolchain, key=_retry_key(token, req),
                                     wait_s=self._queue_wait(req.compile_timeout, req.run_timeout,
                                                             compiles=compile_cmd is not None)) as sb:
                await _put(sb, {plan.source: plan.code.encode(), **files}, recipe.helpers)
                env = {**languages.BASE_ENV, **recipe.env}
                compiled = None
                if compile_cmd is not None:
                    compiled = await self._stage(sb, compile_cmd, env, req.compile_timeout, None, spec)
                ran = None
                if compiled is None or (compiled.status is CommandRunStatus.Finished and compiled.return_code == 0):
                    stdin = req.stdin.encode() if req.stdin is not None else None
                    ran = await self._stage(sb, run_cmd, env, req.run_timeout, stdin, spec)
                fetched = await _fetch(sb, req.fetch_files)
                pod = sb.id
        except _Failed as exc:
            return self._error(RunCodeResponse, str(exc))
        status, message = run_status(compiled, ran)
        self.served += 1
        return RunCodeResponse(status=status, message=message, compile_result=compiled, run_result=ran,
                               executor_pod_name=pod, files=fetched)

    async def run_jupyter(self, control_url: str, token: str, req: RunJupyterRequest) -> RunJupyterResponse:
        recipe = languages.JUPYTER
        self._check_timeouts(req.total_timeout, req.cell_timeout or 1.0)
        spec = self._spec(recipe.toolchain, req.memory_limit_MB)
        budget = req.total_timeout + JUPYTER_START_S
        try:
            files = _decode_files(req.files)
            async with self._sandbox(control_url, token, spec, budget + TTL_MARGIN_S, recipe.toolchain,
                                     key=_retry_key(token, req)) as sb:
                await _put(sb, files, recipe.helpers)
                payload = json.dumps({"cells": req.cells, "cell_timeout": req.cell_timeout,
                                      "total_timeout": req.total_timeout}).encode()
                driver = await self._stage(sb, recipe.run, {**languages.BASE_ENV, **recipe.env}, budget, payload, spec,
                                           output_cap=JUPYTER_OUTPUT_CAP)
                fetched = await _fetch(sb, req.fetch_files)
                pod = sb.id
        except _Failed as exc:
            return self._error(RunJupyterResponse, str(exc))
        self.served += 1
        out = driver.stdout or ""
        head, mark, tail = out.rpartition(JUPYTER_MARK)
        if not mark or driver.status is not CommandRunStatus.Finished:
            # The driver died or ran out of time: SandboxFusion answers Failed with the driver's result.
            return RunJupyterResponse(status=RunStatus.Failed, message="", driver=driver, executor_pod_name=pod,
                                      files=fetched)
        try:
            result = json.loads(tail)
        except ValueError:
            return RunJupyterResponse(status=RunStatus.Failed, driver=driver, executor_pod_name=pod, files=fetched,
                                      message=f"the cells' output is larger than {JUPYTER_OUTPUT_CAP // MiB} MiB")
        driver = driver.model_copy(update={"stdout": head.rstrip("\n")})
        cells = [CellRunResult.model_validate(c) for c in result.get("cells", [])]
        status = RunStatus.Success if result.get("status") == "Finished" else RunStatus.Failed
        return RunJupyterResponse(status=status, message="", driver=driver, cells=cells, executor_pod_name=pod,
                                  files=fetched)

    # ------------------------------------------------------------- helpers ----

    def _check_timeouts(self, *values: float) -> None:
        for v in values:
            if v > self.config.max_timeout_s:
                raise InvalidSpec(f"a timeout of {v:g} s is longer than this service allows "
                                  f"({self.config.max_timeout_s:g} s)", field="timeout")

    def _spec(self, toolchain: str, memory_mb: int) -> SandboxSpec:
        from dsec.images.toolchains import image_for
        from dsec.spec import ImageRef, Resources, SandboxSpec

        cfg = self.config
        mb = cfg.default_memory_mb if memory_mb <= 0 else max(16, memory_mb)
        if mb > cfg.max_memory_mb:
            raise InvalidSpec(f"memory_limit_MB {memory_mb} is more than this service allows ({cfg.max_memory_mb})",
                              field="memory_limit_MB")
        base, toolkits = image_for(toolchain, cfg.suite, cfg.profile)
        return SandboxSpec(
            image=ImageRef(base=base, toolkits=toolkits),
            resources=Resources(cpu=cfg.cpu, memory=mb * MiB, disk=cfg.disk_mb * MiB, pids=cfg.pids),
            output_cap=cfg.output_cap, backend=cfg.backend, labels=dict(LABELS),
        )

    def _unavailable(self, language: str) -> RunCodeResponse:
        """SandboxFusion's answer when its image lacks the language's program (no sandbox made)."""
        entry, stderr = languages.unavailable(language)
        stage = CommandRunResult(status=CommandRunStatus.Finished, execution_time=0.0, return_code=127, stdout="",
                                 stderr=stderr)
        self.unavailable += 1
        return RunCodeResponse(status=RunStatus.Failed, message=f"dsec: {language} cannot run here: {entry.why}",
                               compile_result=stage if entry.stage == "compile" else None,
                               run_result=stage if entry.stage == "run" else None)

    def _error(self, model: type[R], message: str) -> R:
        self.sandbox_errors += 1
        return model(status=RunStatus.SandboxError, message=message)

    def _client(self, control_url: str, token: str) -> AsyncClient:
        from dsec.sdk.client import AsyncClient

        key = (control_url, hashlib.sha256(token.encode()).hexdigest())
        client = self._clients.get(key)
        if client is None:
            client = AsyncClient(control_url, token, timeout=60.0)
            self._clients[key] = client
            while len(self._clients) > MAX_CLIENTS:
                _, old = self._clients.popitem(last=False)
                self._spawn(old.aclose())
        else:
            self._clients.move_to_end(key)
        return client

    def _queue_wait(self, compile_timeout: float, run_timeout: float, *, compiles: bool) -> float:
        """How long a run_code request may wait for a sandbox before its 504: the configured
        ``queue_timeout_s``; unset, as long as its clients' own timeout still leaves it room to
        run, at least ``QUEUE_FLOOR_S``. verl (and the sandbox-fusion client) give a request ``compile_timeout +
        run_timeout + 10`` s; a request with no compile stage never spends its compile
        timeout, so it may wait that much longer (python: ~18 s where the bound alone is 10).
        Waiting past a wave of sandboxes that each run into their timeout is then answered,
        not refused and retried behind newer requests (verl's worst case)."""
        if self.config.queue_timeout_s is not None:
            return self.config.queue_timeout_s
        own = run_timeout + (compile_timeout if compiles else 0.0)
        slack = compile_timeout + run_timeout + CLIENT_SLACK_S - own - QUEUE_MARGIN_S
        return max(QUEUE_FLOOR_S, slack)

    @contextlib.asynccontextmanager
    async def _sandbox(self, control_url: str, token: str, spec: SandboxSpec, ttl: float,
                       toolchain: str, *, key: str | None = None,
                       wait_s: float | None = None) -> AsyncIterator[AsyncSandbox]:
        """A sandbox for one request, taken through the window; deleted in the background after.
        ``key``: the request's (:func:`_retry_key`): answered 504, it keeps its place in the
        queue for a few seconds, for the client's retry of the same request."""
        if self._closed:
            raise _Failed("the service is shutting down")
        client = self._client(control_url, token)
        loop = asyncio.get_running_loop()
        wait_s = (self.config.queue_timeout_s or QUEUE_FLOOR_S) if wait_s is None else wait_s
        deadline = loop.time() + wait_s
        again = False
        refusals = 0
        while True:
            try:
                await self.window.acquire(deadline, again=again, key=key if self.config.retry_hold_s > 0 else None)
            except WindowTimeout as exc:
                self.busy += 1
                raise Busy(f"no sandbox free within {wait_s:g} s: {exc}", retry_after=1.0) from None
            try:
                sb = await client.create(spec, labels=LABELS, ttl_s=ttl)
            except (Backpressure, QuotaExceeded) as exc:
                self.window.refused()
                self.window.release()
                refusals += 1
                retry_after = float(getattr(exc, "retry_after", 1.0) or 1.0)
                if loop.time() >= deadline:
                    self.busy += 1
                    raise Busy(f"no sandbox free within {wait_s:g} s: {exc.message}",
                               retry_after=retry_after) from None
                if self.window.inflight == 0:
                    # Nothing of ours will end to make room: the refusal is someone else's doing.
                    await asyncio.sleep(min(retry_after, 0.05 * 2 ** min(refusals, 5), max(0.0, deadline - loop.time())))
                again = True
                continue
            except ImageError as exc:
                self.window.release()
                profile = f" --profile {self.config.profile}" if self.config.profile else ""
                raise _Failed(f"{exc.message} (the {toolchain} toolchain: `dsec image build --toolchains "
                              f"{toolchain}{profile}`)") from None
            except DsecError as exc:
                self.window.release()
                raise _Failed(f"could not create a sandbox: {exc.code}: {exc.message}") from None
            except BaseException:
                self.window.release()
                raise
            self.window.admitted()
            break
        try:
            yield sb
        except DsecError as exc:
            raise _Failed(f"sandbox {sb.id}: {exc.code}: {exc.message}") from None
        finally:
            self._spawn(self._delete(sb))

    async def _delete(self, sb: AsyncSandbox) -> None:
        try:
            await sb.close()
        except Exception as exc:  # its TTL removes it anyway
            log.warning("sandbox %s: delete failed (%s); its TTL will remove it", sb.id, exc)
        finally:
            self.window.release()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._deletes.add(task)
        task.add_done_callback(self._deletes.discard)

    async def _stage(self, sb: AsyncSandbox, cmd: str, env: dict[str, str], timeout: float, stdin: bytes | None,
                     spec: SandboxSpec, *, output_cap: int | None = None) -> CommandRunResult:
        try:
            res = await sb.exec(languages.argv(cmd), cwd=languages.WORKDIR, env=env, stdin=stdin, timeout=timeout,
                                output_cap=output_cap or self.config.output_cap)
        except ExecTimeout as exc:
            partial: ExecResult | None = exc.fields.get("result")
            return CommandRunResult(
                status=CommandRunStatus.TimeLimitExceeded,
                execution_time=partial.duration_s if partial else timeout,
                stdout=partial.stdout_text if partial else "", stderr=partial.stderr_text if partial else "",
                cpu_time=(partial.cpu_user_s + partial.cpu_system_s) if partial else None,
            )
        stderr = res.stderr_text
        if res.limit is not None and res.limit.kind == "memory":
            sep = "\n" if stderr and not stderr.endswith("\n") else ""
            stderr += f"{sep}dsec: killed by the memory limit ({spec.resources.memory // MiB} MB: memory_limit_MB)\n"
        code = res.exit_code if res.exit_code is not None else -(res.signal or 0)
        return CommandRunResult(status=CommandRunStatus.Finished, execution_time=res.duration_s, return_code=code,
                                stdout=res.stdout_text, stderr=stderr, cpu_time=res.cpu_user_s + res.cpu_system_s)

    # ------------------------------------------------------------ lifetime ----

    def stats(self) -> dict[str, Any]:
        return {"served": self.served, "sandbox_errors": self.sandbox_errors, "busy": self.busy,
                "unavailable": self.unavailable,
                "deleting": len(self._deletes), "window": self.window.stats()}

    async def aclose(self) -> None:
        """Wait (a while) for the background deletes, then close the clients."""
        self._closed = True
        if self._deletes:
            await asyncio.wait(set(self._deletes), timeout=DELETE_WAIT_S)
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.aclose()
        self._clients.clear()


def _decode_files(files: dict[str, str | None]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, content in files.items():
        if content is None or "IGNORE_THIS_FILE" in name:  # as SandboxFusion's runners do
            continue
        try:
            out[name] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise _Failed(f"file {name!r}: its content is not base64") from None
    return out


def _retry_key(token: str, req: RunCodeRequest | RunJupyterRequest) -> str:
    """A request's identity for keeping its place in the queue across the client's retry:
    its caller's token and its whole body (verl and the sandbox-fusion client resend the
    same body after a 504). Two identical requests in flight share it: either takes the place."""
    return hashlib.sha256(token.encode() + b"\0" + req.model_dump_json().encode()).hexdigest()


def _in_sandbox(name: str) -> str:
    """A request's file name (relative to the working directory, or absolute) as an absolute path."""
    path = posixpath.normpath(posixpath.join(languages.WORKDIR, name))
    if path == "/" or not name:
        raise _Failed(f"file {name!r}: not a file name")
    return path


async def _put(sb: AsyncSandbox, files: dict[str, bytes], helpers: Sequence[str]) -> None:
    """Write the code, the request's files and the helpers: one file write when that is all,
    else one tar (directories made on the way)."""
    entries = {_in_sandbox(n): data for n, data in files.items()}
    entries.update({f"{languages.HELPERS}/{h}": helper(h) for h in helpers})
    if len(entries) == 1 and posixpath.dirname(next(iter(entries))) == languages.WORKDIR:
        (path, data), = entries.items()
        await sb.files.write(path, data, parents=True)  # the usual request: its code alone
        return
    buf = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        dirs = {languages.WORKDIR}
        for path in entries:
            parent = posixpath.dirname(path)
            while parent not in ("/", ""):
                dirs.add(parent)
                parent = posixpath.dirname(parent)
        for d in sorted(dirs):
            info = tarfile.TarInfo(d.lstrip("/"))
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(now)
            tar.addfile(info)
        for path, data in entries.items():
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), 0o644, int(now)
            tar.addfile(info, io.BytesIO(data))
    await sb.files.upload("/", buf.getvalue())


async def _fetch(sb: AsyncSandbox, names: Sequence[str]) -> dict[str, str]:
    """``fetch_files`` as base64; a path that is missing (or not a regular file) is left out."""
    out: dict[str, str] = {}
    for name in names:
        try:
            data = await sb.files.read(_in_sandbox(name))
        except (_Failed, SandboxNotFound, DsecError):
            continue
        out[name] = base64.b64encode(data).decode()
    return out
