"""libdsec: the async SDK (the sync one in ``dsec.sdk.sync`` is derived from it).

The control plane is asked to create, list and delete; its answer names the
edge and carries a token scoped to the sandbox, and exec/file traffic then goes
to the edge directly. One asyncio process can drive thousands of sandboxes:
every call is a coroutine on pooled HTTP connections, no thread per sandbox.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import json
import os
import random
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import httpx

from dsec.errors import (
    AuthError,
    Backpressure,
    DsecError,
    ExecTimeout,
    InvalidSpec,
    NotFound,
    QuotaExceeded,
    SandboxNotFound,
    SandboxPreempted,
)
from dsec.sdk._http import UNSET as UNSET  # defined beside the HTTP plumbing, which needs it too
from dsec.sdk._http import Endpoint, Response, _Unset, raise_for_error, result_from_wire
from dsec.sdk.failover import Replicas, split_urls
from dsec.sdk.fncall import FnCalls
from dsec.sdk.leases import AHEAD_SLOTS, LeasesAhead
from dsec.sdk.outcomes import CreateOutcome as CreateOutcome
from dsec.sdk.outcomes import OutputChunk as OutputChunk
from dsec.sdk.outcomes import wire_body as _wire
from dsec.spec import LENIENT, NetworkPolicy, SandboxSpec, SandboxState

if TYPE_CHECKING:
    from dsec.sdk.leases import AsyncLease
    from dsec.sdk.terminal import AsyncTerminal
    from dsec.spec.control import SchedEvent, SchedStatus, TaskDetail
from dsec.spec.api import (
    BatchResult,
    CreateBatch,
    CreateLease,
    CreateProject,
    CreateSandbox,
    CreateToken,
    ExecRequest,
    ExecResultWire,
    FileEntry,
    ForkRequest,
    GroupResult,
    Lifecycle,
    NetworkInfo,
    PauseReport,
    PreemptionInfo,
    ProjectInfo,
    Quota,
    SandboxInfo,
    SandboxStats,
    SessionRun,
    SetStage,
    SnapshotInfo,
    SnapshotRequest,
    StreamChunk,
    TokenInfo,
)
from dsec.spec.results import ExecResult

DEFAULT_EXEC_TIMEOUT: Final = 600.0
EDGE_SHARDS: Final = 32
"""httpx pools per edge (the lean client needs one; see sdk/_http.py Endpoint)."""


_JSON = {"content-type": "application/json"}


def _snapshot_info(data: dict[str, Any]) -> SnapshotInfo:
    """A control plane's answer carries the owner (``StoredSnapshot``); an edge's does not."""
    if "project" in data:
        from dsec.spec.control import StoredSnapshot  # pure data, no server-side imports

        return StoredSnapshot.model_validate(data, context=LENIENT)
    return SnapshotInfo.model_validate(data, context=LENIENT)


def _exec_body(req: ExecRequest) -> str:
    """The request as JSON; an unset ``output_cap`` is left out (edges older than it refuse the field)."""
    return req.model_dump_json(exclude={"output_cap"} if req.output_cap is None else None)


def _labels_query(labels: Mapping[str, str] | None) -> list[tuple[str, str]]:
    return [("label", f"{k}={v}") for k, v in (labels or {}).items()]


class AsyncClient(FnCalls):  # fncall / fncall_many: dsec/sdk/fncall.py
    """Client of a DSec control plane. ``url``/``token`` default to $DSEC_URL/$DSEC_TOKEN.

    ``transport``: an httpx transport that carries every call (tests); without one, plain
    calls to ``http://`` URLs take the lean HTTP/1.1 client (sdk/_http.py :class:`Endpoint`)."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
        lease_ahead: int = AHEAD_SLOTS,
    ) -> None:
        url = url or os.environ.get("DSEC_URL") or "http://127.0.0.1:7070"
        token = token or os.environ.get("DSEC_TOKEN")
        if not token:
            raise AuthError("no API token: pass token=... or set DSEC_TOKEN (`dsec token create` makes one)")
        urls = split_urls(url)
        self.url = urls[0]
        """The (first) control-plane URL; ``url`` may name several replicas, comma-separated
        (sdk/failover.py: calls a replica cannot answer go to the next)."""
        self._token = token
        self._timeout = timeout
        self._transport = transport
        self._http: Endpoint | Replicas
        if len(urls) > 1:
            self._http = Replicas(urls, timeout=timeout, transport=transport,
                                  headers={"authorization": f"Bearer {token}"})
        else:
            self._http = Endpoint(self.url, timeout=timeout, transport=transport,
                                  headers={"authorization": f"Bearer {token}"})
        self._edges: dict[str, Endpoint] = {}
        self._closed = False
        self._ahead = LeasesAhead(self, lease_ahead) if lease_ahead > 0 else None
        """Creates repeated with one body take a slot of a lease held ahead (``lease_ahead``
        slots; 0: every create goes through the control plane). sdk/leases.py."""

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close connections (sandboxes keep running; close them first if you want them gone)."""
        if self._closed:
            return
        self._closed = True
        if self._ahead is not None:
            with contextlib.suppress(Exception):
                await self._ahead.close()  # unused slots: their quota returns now, not at expiry
        await self._http.aclose()
        for c in self._edges.values():
            await c.aclose()
        self._edges.clear()

    def _edge(self, url: str) -> Endpoint:
        """Pooled connections to an edge (its httpx fallback is spread over EDGE_SHARDS pools)."""
        edge = self._edges.get(url)
        if edge is None:
            edge = Endpoint(url, timeout=self._timeout, transport=self._transport, shards=EDGE_SHARDS,
                            max_connections=256)
            self._edges[url] = edge
        return edge

    async def _call(self, method: str, path: str, **kw: Any) -> Response:
        resp = await self._http.request(method, path, **kw)
        raise_for_error(resp)
        return resp

    # ----- sandboxes -----

    async def create(
        self,
        spec: SandboxSpec,
        *,
        labels: Mapping[str, str] | None = None,
        task: str | None = None,
        ttl_s: float = 3600.0,
        idle_timeout_s: float | None = None,
        request_id: str | None = None,
        auto_pause_s: float | None = None,
    ) -> AsyncSandbox:
        """Create one sandbox. Retried creates with the same ``request_id`` make one sandbox.

        ``auto_pause_s``: pause it after that long without requests (any request resumes it).
        Creates repeated with one spec (and labels, task, lifecycle) and no ``request_id`` of
        the caller's take a slot of a small lease held ahead when there is one: the edge makes
        the sandbox without a control-plane call (``AsyncClient(lease_ahead=0)``: never)."""
        body = CreateSandbox(
            spec=spec, labels=dict(labels or {}), task=task,
            lifecycle=Lifecycle(ttl_s=ttl_s, idle_timeout_s=idle_timeout_s, auto_pause_s=auto_pause_s),
        )
        if request_id is None and self._ahead is not None:
            doc = body.model_dump(mode="json", exclude={"request_id"})
            sb = await self._ahead.create(json.dumps(doc, sort_keys=True, separators=(",", ":")), doc)
            if sb is not None:
                return sb
        body.request_id = request_id or uuid.uuid4().hex
        # safe to resend on a dead kept-alive connection: the control plane de-duplicates the request_id
        resp = await self._call("POST", "/v1/sandboxes", content=body.model_dump_json(), headers=_JSON,
                                idempotent=True)
        return AsyncSandbox(self, SandboxInfo.model_validate_json(resp.content, context=LENIENT))

    async def create_many(
        self,
        spec: SandboxSpec,
        n: int,
        *,
        concurrency: int = 64,
        labels: Mapping[str, str] | None = None,
        task: str | None = None,
        ttl_s: float = 3600.0,
        idle_timeout_s: float | None = None,
        max_wait_s: float = 600.0,
        auto_pause_s: float | None = None,
        lease: bool = True,
    ) -> AsyncIterator[CreateOutcome]:
        """Create ``n`` sandboxes, yielding each as it becomes ready (not in order).

        ``lease`` (default): one create lease for the burst (:meth:`lease`): the control plane
        is asked once, the edges make the sandboxes directly; what a lease cannot make (an edge
        full or gone) is created through the control plane (an edge gone with creates in flight:
        once its part of the lease is abandoned, so none is made twice). ``lease=False``: one control-plane
        create per sandbox. Either way, backpressure (429) is honoured with jittered retries
        until ``max_wait_s``; other failures are reported per item and never fail the batch.
        """
        if n < 0 or concurrency < 1:
            raise InvalidSpec("n must be >= 0 and concurrency >= 1", field="n")
        batch_id = uuid.uuid4().hex[:12]
        rest: builtins.list[int] = list(range(n))
        if lease and n > 1:
            from dsec.sdk.leases import retry_elsewhere

            got: AsyncLease | None = None
            try:
                got = await self.lease(spec, n, labels=labels, task=task, ttl_s=ttl_s, idle_timeout_s=idle_timeout_s,
                                       auto_pause_s=auto_pause_s, request_id=f"{batch_id}-lease")
            except (Backpressure, httpx.HTTPError):
                pass  # no room now, or no answer: one create at a time (with retries)
            except DsecError as exc:
                if not (isinstance(exc, NotFound) or exc.fields.get("status") == 404):
                    for i in range(n):  # quota, a bad spec...: every item hears it
                        yield CreateOutcome(i, None, exc)
                    return
                # a control plane without leases (or an unknown layer): one create at a time
            if got is not None:
                rest = []
                try:
                    async for o in got.create(got.slots, concurrency=concurrency):
                        if o.ok or not retry_elsewhere(o.error):
                            yield o
                        else:
                            rest.append(o.index)
                finally:
                    with contextlib.suppress(DsecError, httpx.HTTPError):
                        await got.release()  # before the rest: the unused quota returns first
                err = got.error
                if got.short and isinstance(err, QuotaExceeded):
                    for i in range(got.slots, n):
                        yield CreateOutcome(i, None, err)
                else:
                    rest.extend(range(got.slots, n))
        async for o in self._create_each(spec, rest, batch_id, concurrency=concurrency, labels=labels, task=task,
                                         ttl_s=ttl_s, idle_timeout_s=idle_timeout_s, max_wait_s=max_wait_s,
                                         auto_pause_s=auto_pause_s):
            yield o

    async def lease(
        self,
        spec: SandboxSpec,
        count: int,
        *,
        labels: Mapping[str, str] | None = None,
        task: str | None = None,
        ttl_s: float = 3600.0,
        idle_timeout_s: float | None = None,
        auto_pause_s: float | None = None,
        lease_ttl_s: float = 30.0,
        request_id: str | None = None,
        edge_selector: Mapping[str, str] | None = None,
    ) -> AsyncLease:
        """The right to create ``count`` sandboxes of ``spec`` directly on edges for
        ``lease_ttl_s`` (one control-plane call; docs/CONTROL.md, "Create leases"). The quota
        is charged now; ``await lease.create()`` makes them, ``await lease.release()`` (or
        ``async with``) returns what was not used. The grant may be smaller than ``count``:
        ``lease.short`` and ``lease.error`` say why."""
        from dsec.sdk.leases import grant

        body = _wire(CreateLease, spec=spec, count=count, labels=dict(labels or {}), task=task,
                     lifecycle=Lifecycle(ttl_s=ttl_s, idle_timeout_s=idle_timeout_s, auto_pause_s=auto_pause_s),
                     request_id=request_id or uuid.uuid4().hex, lease_ttl_s=lease_ttl_s,
                     edge_selector=dict(edge_selector or {}))
        return await grant(self, body.model_dump_json())

    async def _create_each(
        self, spec: SandboxSpec, indices: Sequence[int], batch_id: str, *, concurrency: int,
        labels: Mapping[str, str] | None, task: str | None, ttl_s: float, idle_timeout_s: float | None,
        max_wait_s: float, auto_pause_s: float | None,
    ) -> AsyncIterator[CreateOutcome]:
        """One control-plane create per index (request id ``<batch_id>-<i>``), 429s retried."""
        sem = asyncio.Semaphore(concurrency)
        queue: asyncio.Queue[CreateOutcome] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def one(i: int) -> None:
            deadline = loop.time() + max_wait_s
            attempt = 0
            async with sem:
                while True:
                    try:
                        sb = await self.create(spec, labels=labels, task=task, ttl_s=ttl_s,
                                               idle_timeout_s=idle_timeout_s, request_id=f"{batch_id}-{i}",
                                               auto_pause_s=auto_pause_s)
                        await queue.put(CreateOutcome(i, sb, None))
                        return
                    except Backpressure as exc:
                        attempt += 1
                        wait = min(30.0, float(getattr(exc, "retry_after", 1.0) or 1.0) * (1 + attempt * 0.5))
                        wait *= random.uniform(0.5, 1.5)
                        if loop.time() + wait > deadline:
                            await queue.put(CreateOutcome(i, None, exc))
                            return
                        await asyncio.sleep(wait)
                    except DsecError as exc:
                        await queue.put(CreateOutcome(i, None, exc))
                        return
                    except httpx.HTTPError as exc:  # no answer (both clients raise httpx's): same request_id again
                        attempt += 1
                        if attempt > 3 or loop.time() > deadline:
                            await queue.put(CreateOutcome(i, None, DsecError(f"create failed: {exc!r}")))
                            return
                        await asyncio.sleep(random.uniform(0.1, 0.5) * attempt)
                    except Exception as exc:  # anything else fails this item: never the burst, never a hang
                        # (a task that died here left its outcome missing, and the loop below waited forever)
                        await queue.put(CreateOutcome(i, None, DsecError(f"create failed: {exc!r}")))
                        return

        tasks = [asyncio.ensure_future(one(i)) for i in indices]
        try:
            for _ in indices:
                yield await queue.get()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def create_batch(self, spec: SandboxSpec, count: int, *, labels: Mapping[str, str] | None = None,
                           task: str | None = None, ttl_s: float = 3600.0) -> builtins.list[CreateOutcome]:
        """Create ``count`` sandboxes in one request (the control plane fans out)."""
        body = CreateBatch(spec=spec, count=count, labels=dict(labels or {}), task=task,
                           lifecycle=Lifecycle(ttl_s=ttl_s), request_id=uuid.uuid4().hex)
        resp = await self._call("POST", "/v1/sandboxes/batch", content=body.model_dump_json(), headers=_JSON)
        out: list[CreateOutcome] = []
        for i, item in enumerate(BatchResult.model_validate_json(resp.content, context=LENIENT).items):
            if item.sandbox is not None:
                out.append(CreateOutcome(i, AsyncSandbox(self, item.sandbox), None))
            else:
                from dsec.errors import error_from_wire

                out.append(CreateOutcome(i, None, error_from_wire(item.error or {})))
        return out

    async def connect(self, sandbox_id: str) -> AsyncSandbox:
        """Re-attach to a sandbox from any process (fresh data-path token). One that was
        deleted (or has ended otherwise) raises :class:`SandboxNotFound` saying why."""
        info = await self.info(sandbox_id)
        if info.state is SandboxState.LOST:
            from dsec.errors import SandboxLost

            raise SandboxLost(f"sandbox {sandbox_id} was lost with its edge {info.edge_id} ({info.reason})",
                              sandbox_id=sandbox_id, edge_id=info.edge_id, reason=info.reason)
        if info.state is SandboxState.STOPPED and info.preemption is not None and info.preemption.action == "destroy":
            from dsec.errors import SandboxEvicted

            raise SandboxEvicted(f"sandbox {sandbox_id} was destroyed to make room for more urgent work "
                                 f"(priority {info.preemption.by_priority}); create another",
                                 sandbox_id=sandbox_id, by_priority=info.preemption.by_priority, reason=info.reason)
        if info.state is SandboxState.STOPPED or info.token is None:
            raise SandboxNotFound.ended(sandbox_id, info.state.value, info.reason)
        return AsyncSandbox(self, info)

    def _sandbox_of(self, info: SandboxInfo) -> AsyncSandbox:
        """A handle on a sandbox another part of the SDK got (leases)."""
        return AsyncSandbox(self, info)

    async def info(self, sandbox_id: str) -> SandboxInfo:
        resp = await self._call("GET", f"/v1/sandboxes/{sandbox_id}")
        return SandboxInfo.model_validate_json(resp.content, context=LENIENT)

    async def list(
        self, *, labels: Mapping[str, str] | None = None, task: str | None = None, state: str | None = None
    ) -> builtins.list[SandboxInfo]:
        params = _labels_query(labels)
        if task:
            params.append(("task", task))
        if state:
            params.append(("state", state))
        resp = await self._call("GET", "/v1/sandboxes", params=params)
        data = resp.json()
        items = data["items"] if isinstance(data, dict) else data
        return [SandboxInfo.model_validate(x, context=LENIENT) for x in items]

    async def delete(self, sandbox_id: str) -> None:
        """Delete a sandbox; deleting one that is gone is fine."""
        with contextlib.suppress(SandboxNotFound):
            await self._call("DELETE", f"/v1/sandboxes/{sandbox_id}")

    async def delete_where(self, *, labels: Mapping[str, str] | None = None, task: str | None = None) -> int:
        params = _labels_query(labels)
        if task:
            params.append(("task", task))
        if not params:
            raise InvalidSpec("give labels or a task (use delete_all=True semantics via the CLI)", field="labels")
        resp = await self._call("DELETE", "/v1/sandboxes", params=params)
        return int(resp.json().get("deleted", 0))

    async def delete_task(self, task: str) -> int:
        return await self.delete_where(task=task)

    # ----- tasks and scheduling (docs/CONTROL.md, "Scheduling") -----

    async def create_task(
        self,
        name: str,
        *,
        quota: Mapping[str, float] | None = None,
        min: Mapping[str, float] | None = None,
        priority: int | str | None = None,
        preemption: str | None = None,
        burst: bool | None = None,
        project: str | None = None,
    ) -> TaskDetail:
        """Make a task, or set an existing one's quota (its ``max``: always set) and the scheduling
        fields given (the others stay). ``priority``: ``background``, ``training`` (default),
        ``evaluation`` or 0..1000; ``preemption``: ``pause`` (default), ``destroy`` or ``never``;
        ``min``: the guaranteed ``sandboxes``, ``cpu`` and ``memory`` (reserved capacity);
        ``burst``: may go to the burst pool. A priority above training and a min are set by a
        token of an ancestor of the task's ``project`` (default: the caller's), or the root's."""
        from dsec.spec.control import CreateTaskBody, TaskDetail

        body = _wire(CreateTaskBody, name=name, quota=dict(quota or {}), min=dict(min) if min is not None else None,
                     priority=priority, preemption=preemption, burst=burst, project=project)
        resp = await self._call("POST", "/v1/tasks", content=body.model_dump_json(exclude_none=True), headers=_JSON)
        return TaskDetail.model_validate_json(resp.content, context=LENIENT)

    async def task(self, name: str) -> TaskDetail:
        """A task with its quota, use, stages and scheduling (``active``: what it holds now)."""
        from dsec.spec.control import TaskDetail

        return TaskDetail.model_validate_json((await self._call("GET", f"/v1/tasks/{name}")).content, context=LENIENT)

    async def tasks(self) -> builtins.list[TaskDetail]:
        from dsec.spec.control import TaskDetail

        return [TaskDetail.model_validate(x, context=LENIENT) for x in (await self._call("GET", "/v1/tasks")).json()]

    async def sched_events(self, *, task: str | None = None, since: float | None = None,
                           limit: int = 100) -> builtins.list[SchedEvent]:
        """What the scheduler did to this project's sandboxes (``preempted``: ``action`` pause or
        destroy, ``by_priority``; ``resumed``), oldest first, after ``since`` (a time or the last
        event's ``at``)."""
        from dsec.spec.control import SchedEvent

        params: list[tuple[str, str]] = [("limit", str(limit))]
        if task:
            params.append(("task", task))
        if since is not None:
            params.append(("since", repr(float(since))))
        return [SchedEvent.model_validate(x, context=LENIENT) for x in (await self._call("GET", "/v1/sched/events", params=params)).json()]

    async def sched_status(self) -> SchedStatus:
        """The scheduler's picture: utilisation against the burst threshold, both pools, what is
        held back for tasks' minimums, this project's preempted sandboxes."""
        from dsec.spec.control import SchedStatus

        return SchedStatus.model_validate_json((await self._call("GET", "/v1/sched")).content, context=LENIENT)

    # ----- IAM (projects and tokens) -----

    async def create_project(self, name: str, *, quota: Mapping[str, float], parent: str | None = None) -> ProjectInfo:
        """A sub-project whose quota (sandboxes, cpu, memory, and ``storage``: bytes of
        snapshots) is carved out of its parent's."""
        q = dict(quota)
        storage = q.pop("storage", None)  # bytes of snapshots, carved out of the parent's too
        body = CreateProject(name=name, parent=parent, quota=Quota.model_validate(q)).model_dump(mode="json")
        if storage is not None:
            body["quota"]["storage"] = int(storage)
        resp = await self._call("POST", "/v1/projects", json=body)
        return ProjectInfo.model_validate_json(resp.content, context=LENIENT)

    async def list_projects(self) -> builtins.list[ProjectInfo]:
        data = (await self._call("GET", "/v1/projects")).json()
        return [ProjectInfo.model_validate(x, context=LENIENT) for x in (data["items"] if isinstance(data, dict) else data)]

    async def create_token(self, *, project: str | None = None, name: str = "") -> TokenInfo:
        """A new API token (its secret is in ``.token``, shown this once)."""
        body = CreateToken(project=project, name=name)
        return TokenInfo.model_validate_json((await self._call("POST", "/v1/tokens", content=body.model_dump_json(), headers=_JSON)).content, context=LENIENT)

    async def revoke_token(self, token_id: str) -> None:
        await self._call("DELETE", f"/v1/tokens/{token_id}")

    async def edges(self) -> builtins.list[dict[str, Any]]:
        data = (await self._call("GET", "/v1/edges")).json()
        items: list[dict[str, Any]] = data["items"] if isinstance(data, dict) else data
        return items

    async def snapshots(self) -> builtins.list[SnapshotInfo]:
        """Snapshots of the caller's project and its sub-projects (with ``project`` and ``edge_id``)."""
        return [_snapshot_info(x) for x in (await self._call("GET", "/v1/snapshots")).json()]

    async def delete_snapshot(self, ref: str) -> None:
        """Remove a snapshot by ref or digest; a sandbox or snapshot still using it raises a
        ``conflict`` error, and its storage returns to the project's quota."""
        await self._call("DELETE", f"/v1/snapshots/{ref}")

    async def _refresh(self, sb: AsyncSandbox) -> None:
        sb.info = await self.info(sb.id)

    # ----- group pause / resume -----

    async def _group(self, op: str, labels: Mapping[str, str] | None, task: str | None,
                     ids: Sequence[str] | None, concurrency: int) -> GroupResult:
        """One group call (``POST /v1/pause`` / ``/v1/resume``): the control plane picks the caller's
        sandboxes and fans out to their edges at once (an edge-admin client: that edge does it)."""
        if ids is None and not labels and not task:
            raise InvalidSpec("give labels, a task or sandbox ids to " + op, field="labels")
        base: list[tuple[str, str]] = _labels_query(labels) + ([("task", task)] if task else [])
        id_list = list(dict.fromkeys(ids or ()))
        chunks = [id_list[i : i + 200] for i in range(0, len(id_list), 200)] or [[]]
        out = GroupResult()
        for chunk in chunks:  # ids travel in the query string: a few hundred per call
            resp = await self._call("POST", f"/v1/{op}", params=base + [("id", i) for i in chunk],
                                    timeout=httpx.Timeout(max(self._timeout, 600.0), connect=10.0))
            res = GroupResult.model_validate_json(resp.content, context=LENIENT)
            out.done += res.done
            out.skipped += res.skipped
            out.errors.update(res.errors)
            out.seconds += res.seconds
        return out

    async def pause_where(
        self,
        *,
        labels: Mapping[str, str] | None = None,
        task: str | None = None,
        ids: Sequence[str] | None = None,
        concurrency: int = 64,
    ) -> GroupResult:
        """Pause every sandbox of a task or with these labels (or these ids), e.g. when
        a trainer is preempted. Already paused ones are ``skipped``; errors are per sandbox.
        One call: the control plane pauses them on every edge at once (``concurrency`` is unused)."""
        return await self._group("pause", labels, task, ids, concurrency)

    async def resume_where(
        self,
        *,
        labels: Mapping[str, str] | None = None,
        task: str | None = None,
        ids: Sequence[str] | None = None,
        concurrency: int = 64,
    ) -> GroupResult:
        """Resume every paused sandbox of a task / with these labels / among these ids."""
        return await self._group("resume", labels, task, ids, concurrency)


class AsyncSandbox:
    """A handle on one sandbox. ``async with`` closes (deletes) it; closing twice is fine."""

    def __init__(self, client: AsyncClient, info: SandboxInfo) -> None:
        self._client = client
        self.info = info
        self.files = AsyncFiles(self)
        self._closed = False

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} on {self.info.edge_id}>"

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._client._call("DELETE", f"/v1/sandboxes/{self.id}")
        except SandboxNotFound:
            # Unknown to the control plane (a fork child the edge made): delete it at its edge.
            with contextlib.suppress(SandboxNotFound):
                await self._request("DELETE", "", retry_auth=False)

    async def _request(self, method: str, path: str, *, retry_auth: bool = True, **kw: Any) -> Response:
        http = self._client._edge(self.info.edge_url)
        extra = {k: v for k, v in kw.items() if k != "headers"}
        headers = {"authorization": f"Bearer {self.info.token}", **kw.get("headers", {})}
        try:
            resp = await http.request(method, f"/v1/sandboxes/{self.id}{path}", key=self.id, headers=headers, **extra)
        except httpx.TransportError:
            await self._raise_if_lost()  # its edge is gone: the control plane may have declared it lost
            raise
        if resp.status_code == 401 and retry_auth:
            await self._client._refresh(self)  # expired data-path token: get a fresh one
            return await self._request(method, path, retry_auth=False, **kw)
        try:
            raise_for_error(resp)
        except SandboxPreempted:
            if not retry_auth or path == "/resume":
                raise
            # paused by preemption: a request does not wake it, the scheduler does when there is room
            await self._resume_preempted()
            return await self._request(method, path, retry_auth=False, **kw)
        return resp

    async def _resume_preempted(self) -> None:
        """Resume through the control plane (SandboxPreempted, with ``retry_after``, if it has no room yet)."""
        resp = await self._client._call("POST", f"/v1/sandboxes/{self.id}/resume")
        self.info = SandboxInfo.model_validate_json(resp.content, context=LENIENT)

    @property
    def preemption(self) -> PreemptionInfo | None:
        """Set while the scheduler holds this sandbox paused (or after it destroyed it), as of the
        last answer about it (``await client.info(id)`` asks again)."""
        return self.info.preemption

    async def _raise_if_lost(self) -> None:
        """The edge did not answer: if the control plane declared this sandbox lost, say so
        (``SandboxLost``) rather than leave the caller with a connection error."""
        try:
            info = await self._client.info(self.id)
        except Exception:
            return
        if info.state is SandboxState.LOST:
            from dsec.errors import SandboxLost

            self.info = info
            raise SandboxLost(f"sandbox {self.id} was lost with its edge {info.edge_id} ({info.reason})",
                              sandbox_id=self.id, edge_id=info.edge_id, reason=info.reason)

    async def exec(
        self,
        cmd: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        user: int | str = 0,
        stdin: bytes | None = None,
        timeout: float | _Unset | None = UNSET,
        idle_timeout: float | None = None,
        pristine: Sequence[str] = (),
        output_cap: int | None = None,
    ) -> ExecResult:
        """Run a command to completion. A timeout raises :class:`ExecTimeout` with ``.result``.
        When a sandbox limit ended the command (memory, pids, disk, output cap), the result's
        ``limit`` says which, with its value and a one-line ``message``.

        ``pristine``: paths the command sees as they are in the image layers, whatever the
        sandbox did to them (run an evaluation against untouched tests and tools).
        ``output_cap``: bytes of each stream's head and of its tail kept for this command
        (default: the sandbox's ``SandboxSpec.output_cap``)."""
        req = self._exec_request(cmd, env, cwd, user, stdin, timeout, idle_timeout, pristine, output_cap)
        resp = await self._request("POST", "/exec", content=_exec_body(req), headers=_JSON, timeout=self._http_timeout(req))
        return self._finish(result_from_wire(ExecResultWire.model_validate_json(resp.content, context=LENIENT)), req)

    async def exec_stream(
        self,
        cmd: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        user: int | str = 0,
        stdin: bytes | None = None,
        timeout: float | _Unset | None = UNSET,
        idle_timeout: float | None = None,
        pristine: Sequence[str] = (),
        output_cap: int | None = None,
    ) -> AsyncIterator[OutputChunk | ExecResult]:
        """Yield :class:`OutputChunk` as output is produced, then the :class:`ExecResult`.

        The chunks carry all of the output: a reader slower than the command makes the
        command wait, nothing is dropped. The result keeps the capped head and tail (the
        sandbox's ``output_cap``). With ``output_cap=N`` the stream is capped too: the first
        N bytes of each stream as produced, then at the end the last N bytes in one chunk
        whose ``dropped`` counts the bytes left out between them."""
        req = self._exec_request(cmd, env, cwd, user, stdin, timeout, idle_timeout, pristine, output_cap)
        http = self._client._edge(self.info.edge_url)
        headers = {"authorization": f"Bearer {self.info.token}", **_JSON}
        final: ExecResultWire | None = None
        failure: dict[str, Any] | None = None
        resp = await http.open_stream("POST", f"/v1/sandboxes/{self.id}/exec/stream", key=self.id,
                                      content=_exec_body(req), headers=headers, timeout=self._http_timeout(req))
        try:
            if resp.status_code >= 400:
                await resp.aread()
                raise_for_error(resp)
            # Read to the end (the result is the last line) before handing the result over:
            # the line reader and httpx's generators under it finish here, rather than being
            # finalized later on a loop that a sync client's exit may have stopped already
            # (which printed "Task was destroyed but it is pending!" after `dsec exec`); a
            # caller that stops early closes the line reader, then the answer, in that order.
            lines = resp.aiter_lines()
            try:
                async for line in lines:
                    if not line.strip():
                        continue
                    chunk = StreamChunk.model_validate_json(line, context=LENIENT)
                    if chunk.kind in ("stdout", "stderr"):
                        yield OutputChunk(chunk.kind, base64.b64decode(chunk.data_b64 or ""), chunk.dropped_bytes or 0)
                    elif chunk.kind == "result" and chunk.result is not None:
                        final = chunk.result
                    elif chunk.kind == "error":
                        failure = chunk.error or {}
            finally:
                await lines.aclose()  # type: ignore[attr-defined]  # an async generator
        finally:
            await resp.aclose()
        if failure is not None:
            from dsec.errors import error_from_wire

            raise error_from_wire(failure)
        if final is not None:
            yield self._finish(result_from_wire(final), req)

    def _exec_request(self, cmd: Sequence[str] | str, env: Mapping[str, str] | None, cwd: str, user: int | str,
                      stdin: bytes | None, timeout: float | _Unset | None, idle_timeout: float | None,
                      pristine: Sequence[str] = (), output_cap: int | None = None) -> ExecRequest:
        if isinstance(pristine, str):
            raise InvalidSpec("pristine is a list of paths, e.g. pristine=['/tests']", field="pristine")
        return _wire(
            ExecRequest,
            cmd=cmd if isinstance(cmd, str) else list(cmd), env=dict(env or {}), cwd=cwd, user=user,
            stdin_b64=base64.b64encode(stdin).decode() if stdin else None,
            timeout=DEFAULT_EXEC_TIMEOUT if isinstance(timeout, _Unset) else timeout, idle_timeout=idle_timeout,
            pristine=list(pristine), output_cap=output_cap,
        )

    @staticmethod
    def _http_timeout(req: ExecRequest) -> httpx.Timeout:
        limit = None if req.timeout is None else req.timeout + 30.0
        return httpx.Timeout(limit, connect=10.0)

    def _finish(self, result: ExecResult, req: ExecRequest) -> ExecResult:
        if result.timed_out:
            raise ExecTimeout(
                f"command in sandbox {self.id} hit its {result.timed_out} and was killed",
                sandbox_id=self.id, reason=result.timed_out, timeout=req.timeout, result=result,
            )
        return result

    # ----- network policy, stages, audit -----

    def _take_info(self, resp: Response) -> SandboxInfo:
        info = SandboxInfo.model_validate_json(resp.content, context=LENIENT)
        if info.token is None:  # a sandbox token gets no fresh token back: keep ours
            info = info.model_copy(update={"token": self.info.token, "token_expires_at": self.info.token_expires_at})
        self.info = info
        return info

    async def set_policy(self, policy: NetworkPolicy | Mapping[str, Any] | None) -> SandboxInfo:
        """Replace what the sandbox may reach, atomically, while it runs; ``None``: no network.

        Connections the new policy forbids are cut. Names in ``policy.allow`` are the edge's
        configured permissions (an unknown one raises :class:`InvalidSpec`, nothing changes)."""
        if policy is not None and not isinstance(policy, NetworkPolicy):
            policy = _wire(NetworkPolicy, **dict(policy))
        body = "null" if policy is None else policy.model_dump_json()
        return self._take_info(await self._request("PUT", "/policy", content=body, headers=_JSON))

    async def set_stage(self, name: str) -> SandboxInfo:
        """Switch to one of the stages declared in the spec: its file rules and network policy
        apply from now on, and processes started before the switch are killed."""
        body = _wire(SetStage, stage=name)
        return self._take_info(await self._request("POST", "/stage", content=body.model_dump_json(), headers=_JSON))

    async def network(self) -> NetworkInfo:
        """The sandbox's address, the policy in force and its denied-attempt counters."""
        return NetworkInfo.model_validate_json((await self._request("GET", "/network")).content, context=LENIENT)

    async def events(self) -> builtins.list[dict[str, Any]]:
        """The sandbox's event log, oldest first: execs, limit hits (``oom``, ``pids_limit``,
        ``disk_full``, ``output_capped``), ``net_denied``, ``policy_changed``, ``stage_changed``..."""
        data = (await self._request("GET", "/events")).json()
        return list(data)

    async def stats(self) -> SandboxStats:
        """What the sandbox uses now beside its limits: CPU seconds of its live processes (two
        reads give a rate), memory, writable-layer bytes, processes."""
        return SandboxStats.model_validate_json((await self._request("GET", "/stats")).content, context=LENIENT)

    # ----- pause, snapshots, forks -----

    async def pause(self) -> PauseReport:
        """Freeze every process and push the sandbox's memory out to compressed swap.

        Any later exec, file or session call resumes it (or call :meth:`resume`).
        Pausing a paused sandbox raises :class:`SandboxStateError`."""
        return PauseReport.model_validate_json((await self._request("POST", "/pause")).content, context=LENIENT)

    async def resume(self) -> None:
        """Thaw a paused sandbox (SandboxStateError if it is not paused). One the scheduler paused
        is resumed through the control plane, which finds it room on its edge first
        (SandboxPreempted, with ``retry_after``, when there is none yet)."""
        try:
            await self._request("POST", "/resume")
        except SandboxPreempted:
            await self._resume_preempted()

    async def snapshot(self, *, name: str | None = None, tag: str | None = None,
                       exclude: Sequence[str] = ()) -> SnapshotInfo:
        """Pack this sandbox's disk changes into a snapshot layer; start new sandboxes from it
        with ``ImageRef(base=info.ref)`` (it brings the layers beneath it). ``exclude`` leaves
        paths out (``/abs/path``, globs, or names like ``__pycache__``)."""
        body = _wire(SnapshotRequest, name=name, tag=tag, exclude=list(exclude))
        # through the control plane: the snapshot is the project's and counts against its storage quota
        resp = await self._client._call("POST", f"/v1/sandboxes/{self.id}/snapshot", content=body.model_dump_json(),
                                        headers=_JSON, timeout=httpx.Timeout(600.0, connect=10.0))
        return _snapshot_info(resp.json())

    async def fork(self, n: int, *, exclude: Sequence[str] = (), ttl_s: float | None = None,
                   labels: Mapping[str, str] | None = None) -> builtins.list[AsyncSandbox]:
        """``n`` new sandboxes whose disks equal this one's now, each with its own identity
        (hostname, machine-id). Works on a paused sandbox. All or nothing."""
        life = None if ttl_s is None else Lifecycle(ttl_s=ttl_s)
        body = _wire(ForkRequest, n=n, exclude=list(exclude), lifecycle=life,
                     labels=None if labels is None else dict(labels))
        # through the control plane: the children are charged to the project's and task's quotas
        resp = await self._client._call("POST", f"/v1/sandboxes/{self.id}/fork", content=body.model_dump_json(),
                                        headers=_JSON, timeout=httpx.Timeout(600.0, connect=10.0))
        return [AsyncSandbox(self._client, SandboxInfo.model_validate(x, context=LENIENT)) for x in resp.json()]

    async def session(self) -> AsyncSession:
        """A persistent shell: cwd, variables and functions carry from one command to the next."""
        resp = await self._request("POST", "/sessions")
        return AsyncSession(self, str(resp.json()["session_id"]))

    async def pty(
        self,
        cmd: Sequence[str] | str | None = None,
        *,
        rows: int = 24,
        cols: int = 80,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        user: int | str = 0,
    ) -> AsyncTerminal:
        """An interactive terminal: ``cmd`` (default: the image's login shell) on a real
        pseudo-terminal in the sandbox, with job control (``send("\\x03")`` interrupts the
        foreground job), :meth:`~AsyncTerminal.resize` and the exit status at the end.

        ``name``: a terminal that outlives this connection — attach to it again with the
        same name (its recent screen is replayed); leaving does not end it."""
        from dsec.sdk.terminal import attach_request, open_terminal

        return await open_terminal(self, attach_request(cmd, tty=True, rows=rows, cols=cols, name=name, env=env,
                                                        cwd=cwd, user=user))

    async def attach(
        self,
        cmd: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        user: int | str = 0,
    ) -> AsyncTerminal:
        """Start ``cmd`` with its stdin streamed (:meth:`~AsyncTerminal.send`, then
        :meth:`~AsyncTerminal.eof`) and its stdout and stderr coming back as produced."""
        from dsec.sdk.terminal import attach_request, open_terminal

        return await open_terminal(self, attach_request(cmd, tty=False, rows=24, cols=80, name=None, env=env,
                                                        cwd=cwd, user=user))


class AsyncSession:
    def __init__(self, sandbox: AsyncSandbox, session_id: str) -> None:
        self.sandbox = sandbox
        self.id = session_id
        self._closed = False

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def run(self, command: str, *, timeout: float | None = DEFAULT_EXEC_TIMEOUT) -> ExecResult:
        body = SessionRun(command=command, timeout=timeout)
        resp = await self.sandbox._request(
            "POST", f"/sessions/{self.id}/run", content=body.model_dump_json(), headers=_JSON,
            timeout=httpx.Timeout(None if timeout is None else timeout + 30.0, connect=10.0),
        )
        result = result_from_wire(ExecResultWire.model_validate_json(resp.content, context=LENIENT))
        if result.timed_out:
            raise ExecTimeout(f"session command in {self.sandbox.id} timed out after {timeout} s",
                              sandbox_id=self.sandbox.id, reason="timeout", timeout=timeout, result=result)
        return result

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(DsecError):
            await self.sandbox._request("DELETE", f"/sessions/{self.id}")


class AsyncFiles:
    """Files of one sandbox, confined to its root on the edge."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def read(self, path: str) -> bytes:
        return (await self._sb._request("GET", "/files", params={"path": path})).content

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def write(self, path: str, data: bytes | str, *, mode: int = 0o644, parents: bool = False) -> None:
        """Replace ``path`` atomically; ``parents``: make missing directories on the way."""
        content = data.encode() if isinstance(data, str) else data
        params = {"path": path, "mode": oct(mode)[2:], **({"parents": "1"} if parents else {})}
        await self._sb._request("PUT", "/files", params=params, content=content)

    async def append(self, path: str, data: bytes | str) -> None:
        content = data.encode() if isinstance(data, str) else data
        await self._sb._request("POST", "/files/append", params={"path": path}, content=content)

    async def list(self, path: str = "/") -> list[FileEntry]:
        resp = await self._sb._request("GET", "/files/list", params={"path": path})
        return [FileEntry.model_validate(x, context=LENIENT) for x in resp.json()]

    async def stat(self, path: str) -> FileEntry:
        return FileEntry.model_validate_json((await self._sb._request("GET", "/files/stat", params={"path": path})).content, context=LENIENT)

    async def mkdir(self, path: str, *, parents: bool = False) -> None:
        await self._sb._request("POST", "/files/mkdir", params={"path": path, "parents": int(parents)})

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._sb._request("DELETE", "/files", params={"path": path, "recursive": int(recursive)})

    async def rename(self, src: str, dst: str) -> None:
        await self._sb._request("POST", "/files/rename", params={"src": src, "dst": dst})

    async def upload(self, path: str, tar_bytes: bytes) -> int:
        """Extract a tar archive into directory ``path`` in the sandbox."""
        # httpx: its timeout is per read, so a long transfer that keeps moving is not cut short
        resp = await self._sb._request("PUT", "/files/tar", params={"path": path}, content=tar_bytes, lean=False)
        return int(json.loads(resp.content).get("entries", 0))

    async def download(self, path: str = "/") -> bytes:
        """A tar of ``path`` in the sandbox."""
        return (await self._sb._request("GET", "/files/tar", params={"path": path}, lean=False)).content
