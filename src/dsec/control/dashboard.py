"""The operators' view: a web dashboard, the read-only admin API behind it, and ``/metrics``.

- ``GET /dashboard/`` serves plain HTML, CSS and vanilla JS from ``control/static/`` (package
  data, no build step). The page holds no data: it asks the JSON endpoints below with the
  token the operator typed once (kept in the tab's ``sessionStorage``), every two seconds.
  Served with a strict Content-Security-Policy (scripts and styles from this origin only,
  no inline code), and the script writes every value as text, never as markup.
- ``GET /v1/admin/overview``: projects and quotas, tasks, edges and their load, the newest
  sandboxes (filtered by state, project, task) with counts by state, and this replica's
  create figures (:mod:`dsec.control.stats`: creates/s, errors by code, latency, the last
  errors). ``GET /v1/admin/sandboxes/{id}``: one sandbox with its limits, what it uses now
  and its event log, both asked from its edge. Both need an operator: the root project's
  token or an edge-admin token, like ``GET /v1/edges``. They only read.
- ``GET /metrics``: this replica's counters in the Prometheus text format (open, as the
  edges' are: counts only, no names or messages).

Docs: docs/DASHBOARD.md. Nothing here writes to the store.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import RedirectResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from pydantic import BaseModel, ValidationError
from sqlalchemy.orm import Session

from dsec.control import validate
from dsec.control.db import EdgeRow, Project, SandboxRow, Task
from dsec.control.edges import edge_info, edge_of
from dsec.control.errors import NotFound
from dsec.control.iam import project_info, task_quota_of, used_of
from dsec.control.service import Control
from dsec.control.stats import LATENCY_BUCKETS, CreateStats
from dsec.errors import DsecError, SandboxNotFound
from dsec.spec import SandboxSpec, SandboxState
from dsec.spec.api import EdgeInfo, ProjectInfo, SandboxInfo, SandboxStats, TaskInfo

STATIC = Path(__file__).with_name("static")
ASSETS = {"index.html": "text/html", "dashboard.js": "text/javascript", "dashboard.css": "text/css"}
"""What ``/dashboard/`` serves: these files and nothing else (no paths from the request)."""
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
MAX_EVENTS = 200
"""The newest events of a sandbox the detail answer carries (``events_total`` counts all)."""
MAX_TASKS = 1000
EDGE_CALL_TIMEOUT_S = 5.0


# ------------------------------------------------------------ answers ----


class ErrorItem(BaseModel):
    at: float
    code: str
    message: str
    project: str
    status: int


class CreateFigures(BaseModel):
    """This replica's creates (each batch item counts) since ``since``."""

    since: float
    ok_total: int
    failed_total: int
    failed_by_code: dict[str, int]
    per_s_10s: float
    """Creates answered with a sandbox per second, over the last 10 whole seconds."""
    failed_per_s_10s: float
    per_s_60s: float
    failed_per_s_60s: float
    series_start: int
    """The epoch second of ``series_ok[0]`` and ``series_failed[0]`` (one value per second)."""
    series_ok: list[int]
    series_failed: list[int]
    latency_p50_s: float | None
    latency_p99_s: float | None
    latency_max_s: float | None
    """Of the last 1,000 creates, refused ones included."""
    recent_errors: list[ErrorItem]
    """The last 20 refused or failed creates, newest first."""
    optimistic_launched: int
    optimistic_discarded: int


class ProjectRow(ProjectInfo):
    depth: int
    """0 for a root project, 1 for its children..."""
    storage_quota: int
    storage_used: int


class TaskRow(TaskInfo):
    stage: str | None
    """The stage its new sandboxes start in (the last one switched to)."""
    stages: list[str]


class EdgeRowOut(EdgeInfo):
    layers: int
    """How many layer references the edge holds (the list itself is left out of ``health``)."""


class Overview(BaseModel):
    now: float
    """The control plane's clock (ages are computed against it)."""
    store: str
    watcher_rounds: int
    creates: CreateFigures
    sandbox_counts: dict[str, int]
    """Sandboxes by state, all projects (stopped ones are kept for ``retention_s``)."""
    reserving: int
    """Creates holding a reservation whose edge has not answered yet."""
    sandboxes_matching: int
    sandboxes: list[SandboxInfo]
    """The newest ``limit`` sandboxes matching the filter (no tokens)."""
    projects: list[ProjectRow]
    tasks: list[TaskRow]
    tasks_total: int
    edges: list[EdgeRowOut]


class EdgeError(BaseModel):
    code: str
    message: str


class SandboxDetail(BaseModel):
    sandbox: SandboxInfo
    lifecycle: dict[str, Any]
    stats: SandboxStats | None
    """What it uses now beside its limits (from its edge); None with ``stats_error``."""
    stats_error: EdgeError | None = None
    events: list[dict[str, Any]]
    """Its event log on the edge, the newest :data:`MAX_EVENTS`, oldest first."""
    events_total: int
    events_error: EdgeError | None = None
    now: float


# --------------------------------------------------------------- reads ----


def figures(stats: CreateStats, *, launched: int, discarded: int) -> CreateFigures:
    series = stats.series()
    ok10, bad10 = stats.rate(10)
    ok60, bad60 = stats.rate(60)
    lat = stats.recent_latency()
    return CreateFigures(
        since=stats.started_at, ok_total=stats.ok_total, failed_total=stats.failed_total,
        failed_by_code=dict(stats.failed_by_code.most_common()),
        per_s_10s=ok10, failed_per_s_10s=bad10, per_s_60s=ok60, failed_per_s_60s=bad60,
        series_start=series[0][0] if series else 0,
        series_ok=[s[1] for s in series], series_failed=[s[2] for s in series],
        latency_p50_s=lat["p50"], latency_p99_s=lat["p99"], latency_max_s=lat["max"],
        recent_errors=[ErrorItem(at=e.at, code=e.code, message=e.message, project=e.project, status=e.status)
                       for e in reversed(stats.recent_errors)],
        optimistic_launched=launched, optimistic_discarded=discarded,
    )


def _project_rows(s: Session) -> list[ProjectRow]:
    projects = list(s.execute(sa.select(Project)).scalars())
    by_id = {p.id: p for p in projects}
    children: dict[int | None, list[Project]] = {}
    for p in projects:
        parent = p.parent_id if p.parent_id in by_id else None
        children.setdefault(parent, []).append(p)
    out: list[ProjectRow] = []

    def walk(parent: int | None, depth: int) -> None:  # depth first, siblings by name: a tree
        for p in sorted(children.get(parent, ()), key=lambda x: x.name):
            info = project_info(s, p)
            out.append(ProjectRow(**info.model_dump(), depth=depth, storage_quota=p.quota_storage,
                                  storage_used=p.used_storage))
            walk(p.id, depth + 1)

    walk(None, 0)
    return out


def sandbox_info(ctl: Control, row: SandboxRow, project: str, *, url: str | None = None) -> SandboxInfo:
    """The row as ``GET /v1/sandboxes`` lists it, plus what its stored spec says: image,
    resources (the limits), stage, backend."""
    info = ctl.sandboxes.info(row, project, token=False, url=url)
    try:
        spec = SandboxSpec.model_validate(row.spec or {})
    except ValidationError:  # a row written by an older version: shown without them
        return info
    return info.model_copy(update={
        "image": spec.image, "resources": spec.resources, "backend": spec.backend,
        "stage": spec.stage, "stages": sorted(spec.stages), "network": spec.network,
    })


def _edge_row(e: EdgeRow) -> EdgeRowOut:
    info = edge_info(e)
    layers = 0
    if info.health is not None:
        layers = len(info.health.layers)
        info.health.layers = []
    return EdgeRowOut(**info.model_dump(), layers=layers)


def overview_txn(
    s: Session, ctl: Control, *, states: list[str], project: str | None, task: str | None, limit: int,
) -> dict[str, Any]:
    counts = {st.value: 0 for st in SandboxState}
    reserving = 0
    for state, with_id, n in s.execute(
        sa.select(SandboxRow.state, SandboxRow.id.is_not(None), sa.func.count()).group_by(
            SandboxRow.state, SandboxRow.id.is_not(None))
    ):
        counts[state] = counts.get(state, 0) + n
        if not with_id:
            reserving += n

    where: list[sa.ColumnElement[bool]] = [SandboxRow.id.is_not(None)]
    where.append(SandboxRow.state.in_(states) if states else SandboxRow.state != SandboxState.STOPPED.value)
    if project is not None:
        where.append(Project.name == project)
    if task is not None:
        where.append(SandboxRow.task_name == task)
    base = sa.select(SandboxRow, Project.name).join(Project, Project.id == SandboxRow.project_id).where(*where)
    matching = s.execute(sa.select(sa.func.count()).select_from(base.subquery())).scalar_one()
    rows = s.execute(base.order_by(SandboxRow.created_at.desc(), SandboxRow.key).limit(limit)).all()
    sandboxes = [sandbox_info(ctl, row, name) for row, name in rows]

    tasks_total = s.execute(sa.select(sa.func.count()).select_from(Task)).scalar_one()
    tasks = [
        TaskRow(name=t.name, project=pname, quota=task_quota_of(t), used=used_of(t).to_quota(),
                created_at=t.created_at, stage=(t.stages or {}).get("stage"),
                stages=sorted(((t.stages or {}).get("stages") or {}).keys()))
        for t, pname in s.execute(
            sa.select(Task, Project.name).join(Project, Project.id == Task.project_id)
            .order_by(Project.name, Task.name).limit(MAX_TASKS)
        ).all()
    ]
    edges = [_edge_row(e) for e in s.execute(sa.select(EdgeRow).order_by(EdgeRow.id)).scalars()]
    return {
        "sandbox_counts": counts, "reserving": reserving, "sandboxes_matching": matching, "sandboxes": sandboxes,
        "projects": _project_rows(s), "tasks": tasks, "tasks_total": tasks_total, "edges": edges,
    }


async def _edge_read(call: Awaitable[Any]) -> tuple[Any, EdgeError | None]:
    try:
        async with asyncio.timeout(EDGE_CALL_TIMEOUT_S):
            return await call, None
    except DsecError as exc:
        return None, EdgeError(code=exc.code, message=exc.message)
    except TimeoutError:
        return None, EdgeError(code="host_error", message=f"the edge did not answer within {EDGE_CALL_TIMEOUT_S:g} s")


# ------------------------------------------------------------- metrics ----


class _ControlCollector:
    """The replica's counters, read at scrape time (one source: :class:`CreateStats`)."""

    def __init__(self, ctl: Control) -> None:
        self.ctl = ctl

    def collect(self) -> Iterable[Metric]:
        stats = self.ctl.sandboxes.stats
        creates = CounterMetricFamily(
            "dsec_control_creates", "Creates answered by this replica (batch items count): ok, or failed with the "
            "error code", labels=["result", "code"])
        creates.add_metric(["ok", ""], stats.ok_total)
        for code, n in sorted(stats.failed_by_code.items()):
            creates.add_metric(["failed", code], n)
        yield creates
        buckets: list[tuple[str, float]] = []
        acc = 0
        for bound, n in zip((*LATENCY_BUCKETS, float("inf")), stats.latency_counts, strict=True):
            acc += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), acc))
        latency = HistogramMetricFamily("dsec_control_create_seconds", "Create latency on the control plane "
                                        "(reservation, edge call, answer), refused creates included")
        latency.add_metric([], buckets, sum_value=stats.latency_sum)
        yield latency
        planner = self.ctl.sandboxes.planner
        launch = CounterMetricFamily("dsec_control_optimistic_launches", "Edge calls started before the "
                                     "reservation (planner.py): launched, or discarded when the store disagreed",
                                     labels=["outcome"])
        launch.add_metric(["launched"], planner.launched)
        launch.add_metric(["discarded"], planner.discarded)
        yield launch
        yield CounterMetricFamily("dsec_control_watcher_rounds", "Watcher rounds run by this replica",
                                  value=self.ctl.watcher.rounds if self.ctl.watcher else 0)


def render_metrics(ctl: Control) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ControlCollector(ctl))
    return generate_latest(registry)


# -------------------------------------------------------------- routes ----


def router(operator: Callable[..., Awaitable[str]]) -> APIRouter:
    """The dashboard's routes; ``operator`` is the app's dependency admitting the root
    project's token or an edge-admin token (app.py)."""
    r = APIRouter()
    admin = [Depends(operator)]  # in the decorators: a local alias would not resolve in annotations

    def ctl_of(request: Request) -> Control:
        ctl: Control = request.app.state.ctl
        return ctl

    def asset(name: str) -> Response:
        return Response((STATIC / name).read_bytes(), media_type=ASSETS[name], headers=HEADERS)

    @r.get("/dashboard", include_in_schema=False)
    async def dashboard_root() -> Response:
        return RedirectResponse("dashboard/", status_code=307)  # relative: works behind a path prefix

    @r.get("/dashboard/", include_in_schema=False)
    async def dashboard_index() -> Response:
        return asset("index.html")

    @r.get("/dashboard/{name}", include_in_schema=False)
    async def dashboard_asset(name: str) -> Response:
        if name not in ASSETS:
            raise NotFound(f"no dashboard file {name[:80]!r}")
        return asset(name)

    @r.get("/v1/admin/overview", tags=["admin"], dependencies=admin)
    async def overview(
        request: Request,
        state: Annotated[list[SandboxState], Query(description="sandboxes in these states (default: all but stopped)")] = [],  # noqa: B006
        project: Annotated[str | None, Query(max_length=63)] = None,
        task: Annotated[str | None, Query(max_length=63)] = None,
        limit: Annotated[int, Query(ge=1, le=5000)] = 200,
    ) -> Overview:
        """What the dashboard shows: projects and quotas, tasks, edges, the newest sandboxes and
        this replica's create figures. Read-only; the root project's token or an edge-admin token."""
        ctl = ctl_of(request)
        await ctl.sandboxes.settled()  # creates answered by this replica are listed
        project = validate.name_filter(project, "project")
        task = validate.name_filter(task, "task")
        parts = await ctl.db.read(lambda s: overview_txn(
            s, ctl, states=[x.value for x in state], project=project, task=task, limit=limit))
        planner = ctl.sandboxes.planner
        return Overview(
            now=time.time(), store=ctl.db.dialect,
            watcher_rounds=ctl.watcher.rounds if ctl.watcher else 0,
            creates=figures(ctl.sandboxes.stats, launched=planner.launched, discarded=planner.discarded),
            **parts,
        )

    @r.get("/v1/admin/sandboxes/{sandbox_id}", tags=["admin"], dependencies=admin)
    async def sandbox_detail(request: Request, sandbox_id: str) -> SandboxDetail:
        """Any project's sandbox with its lifecycle, what it uses now beside its limits and its
        event log (the last two from its edge; an edge that does not answer is reported in
        ``stats_error`` / ``events_error``, not as a failure of this call)."""
        ctl = ctl_of(request)
        sid = validate.sandbox_id(sandbox_id)
        await ctl.sandboxes.settled(sid)

        def txn(s: Session) -> tuple[SandboxRow, str]:
            hit = s.execute(sa.select(SandboxRow, Project.name).join(Project, Project.id == SandboxRow.project_id)
                            .where(SandboxRow.id == sid)).first()
            if hit is None:
                raise SandboxNotFound(f"no sandbox {sid!r}", sandbox_id=sid)
            return hit[0], hit[1]

        row, pname = await ctl.db.read(txn)
        edge_id = row.edge_id or edge_of(sid)
        url = await ctl.directory.url(edge_id) or row.edge_url
        info = sandbox_info(ctl, row, pname, url=url)
        edges = ctl.edge_client
        assert edges is not None
        (stats, stats_err), (events, events_err) = await asyncio.gather(
            _edge_read(edges.stats(edge_id, url, sid)), _edge_read(edges.events(edge_id, url, sid)))
        events = events or []
        return SandboxDetail(
            sandbox=info, lifecycle=dict(row.lifecycle or {}), stats=stats, stats_error=stats_err,
            events=events[-MAX_EVENTS:], events_total=len(events), events_error=events_err,
            now=time.time(),
        )

    @r.get("/metrics", tags=["meta"], responses={200: {"content": {"text/plain": {}}}})
    async def metrics(request: Request) -> Response:
        """This replica's counters, Prometheus text format (docs/DASHBOARD.md lists them)."""
        return Response(render_metrics(ctl_of(request)), media_type="text/plain; version=0.0.4; charset=utf-8")

    return r
