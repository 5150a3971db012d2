"""IAM: nested projects with carved quotas, API tokens, tasks.

Quota model (docs/CONTROL.md): every project has a concrete quota
(sandboxes, cpu, memory). A child's quota is *carved out* of its parent's:
for every project P, ``used(P) + sum(quota(child) for child of P) <= quota(P)``
in each dimension, where ``used(P)`` counts P's own sandboxes (creating or
running). Because the invariant holds at every level, admitting a sandbox
into P only has to check P itself (and its task): nothing above P can be
overdrawn by it. A create therefore locks one project row, not the chain.

A task is a named group inside one project with an optional ceiling per
dimension; it is a cap, not a reservation (tasks come and go with training
jobs, and reserving for them would strand quota).

API tokens are ``dsk_`` + 32 random bytes (urlsafe), shown once and stored as
SHA-256. A token acts for its project and every descendant, never upward or
sideways. The arithmetic here is pure (unit-tested); the functions taking a
``Session`` run inside one store transaction and never await.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from dsec.control.db import PROJECTS, TASKS, ApiToken, Project, SandboxRow, SnapshotRow, Task
from dsec.control.errors import Conflict, NotFound
from dsec.control.locking import add_new, lock_one
from dsec.errors import AuthError, Forbidden, InvalidSpec, QuotaExceeded
from dsec.http.auth import hash_api_token
from dsec.spec import Resources, Stage
from dsec.spec.api import NAME_PATTERN, ProjectInfo, Quota, TaskQuota, TokenInfo
from dsec.spec.control import TaskDetail

TOKEN_PREFIX = "dsk_"
_NAME = re.compile(NAME_PATTERN)
DIMENSIONS = ("sandboxes", "cpu", "memory")


# ------------------------------------------------------------ arithmetic ----


def cpu_to_m(cores: float) -> int:
    """Cores -> millicores (exact integer sums); a positive request never rounds to 0."""
    m = round(cores * 1000)
    return max(m, 1) if cores > 0 else 0


@dataclass(frozen=True, slots=True)
class Amount:
    """A vector of (sandboxes, millicores, bytes of memory)."""

    sandboxes: int = 0
    cpu_m: int = 0
    memory: int = 0

    def __add__(self, other: Amount) -> Amount:
        return Amount(self.sandboxes + other.sandboxes, self.cpu_m + other.cpu_m, self.memory + other.memory)

    def __sub__(self, other: Amount) -> Amount:
        return Amount(self.sandboxes - other.sandboxes, self.cpu_m - other.cpu_m, self.memory - other.memory)

    def __mul__(self, n: int) -> Amount:
        return Amount(self.sandboxes * n, self.cpu_m * n, self.memory * n)

    def get(self, dim: str) -> int:
        return {"sandboxes": self.sandboxes, "cpu": self.cpu_m, "memory": self.memory}[dim]

    @classmethod
    def of_quota(cls, q: Quota) -> Amount:
        return cls(q.sandboxes, cpu_to_m(q.cpu), q.memory)

    @classmethod
    def of_resources(cls, r: Resources, count: int = 1) -> Amount:
        return cls(count, cpu_to_m(r.cpu) * count, r.memory * count)

    def to_quota(self) -> Quota:
        return Quota(sandboxes=max(self.sandboxes, 0), cpu=max(self.cpu_m, 0) / 1000, memory=max(self.memory, 0))

    def exceeds(self, limit: Amount) -> list[str]:
        """The dimensions in which this amount is above ``limit``."""
        return [d for d in DIMENSIONS if self.get(d) > limit.get(d)]


def _shown(dim: str, value: int) -> float | int:
    return value / 1000 if dim == "cpu" else value


def check_fits(
    *, project: str, quota: Amount, used: Amount, reserved: Amount, want: Amount, what: str = "project"
) -> None:
    """Raise QuotaExceeded (with fields) unless ``used + reserved + want <= quota``."""
    if (used.sandboxes + reserved.sandboxes + want.sandboxes <= quota.sandboxes  # the common case, spelled out
            and used.cpu_m + reserved.cpu_m + want.cpu_m <= quota.cpu_m
            and used.memory + reserved.memory + want.memory <= quota.memory):
        return
    over = (used + reserved + want).exceeds(quota)
    if not over:
        return
    dim = over[0]
    available = quota.get(dim) - used.get(dim) - reserved.get(dim)
    raise QuotaExceeded(
        f"{what} {project!r} is over its {dim} quota: limit {_shown(dim, quota.get(dim))}, "
        f"in use {_shown(dim, used.get(dim))}, carved out by sub-projects {_shown(dim, reserved.get(dim))}, "
        f"requested {_shown(dim, want.get(dim))}",
        project=project,
        resource=dim,
        limit=_shown(dim, quota.get(dim)),
        used=_shown(dim, used.get(dim)),
        reserved=_shown(dim, reserved.get(dim)),
        requested=_shown(dim, want.get(dim)),
        available=_shown(dim, max(available, 0)),
        dimensions=over,
    )


def check_task_fits(*, task: str, project: str, quota: TaskQuota, used: Amount, want: Amount) -> None:
    if ((quota.sandboxes is None or used.sandboxes + want.sandboxes <= quota.sandboxes)
            and (quota.memory is None or used.memory + want.memory <= quota.memory)
            and (quota.cpu is None or used.cpu_m + want.cpu_m <= cpu_to_m(quota.cpu))):
        return
    limit = task_limit(quota)
    total = used + want
    over = [d for d in DIMENSIONS if limit.get(d) is not None and total.get(d) > (limit.get(d) or 0)]
    if not over:
        return
    dim = over[0]
    cap = limit.get(dim) or 0
    raise QuotaExceeded(
        f"task {task!r} of project {project!r} is over its {dim} quota: limit {_shown(dim, cap)}, "
        f"in use {_shown(dim, used.get(dim))}, requested {_shown(dim, want.get(dim))}",
        project=project,
        task=task,
        resource=dim,
        limit=_shown(dim, cap),
        used=_shown(dim, used.get(dim)),
        requested=_shown(dim, want.get(dim)),
        available=_shown(dim, max(cap - used.get(dim), 0)),
        dimensions=over,
    )


def task_limit(q: TaskQuota) -> dict[str, int | None]:
    return {
        "sandboxes": q.sandboxes,
        "cpu": None if q.cpu is None else cpu_to_m(q.cpu),
        "memory": q.memory,
    }


def check_child_quota(
    *, parent: str, parent_quota: Amount, parent_used: Amount, parent_reserved: Amount,
    old: Amount, new: Amount,
) -> None:
    """A child's quota moving from ``old`` to ``new`` must still fit in the parent's."""
    check_fits(
        project=parent, quota=parent_quota, used=parent_used, reserved=parent_reserved - old,
        want=new, what="parent project",
    )


def check_child_covers_itself(*, project: str, new: Amount, used: Amount, reserved: Amount) -> None:
    """Shrinking a project below what it uses or has carved out for its children is refused."""
    below = (used + reserved).exceeds(new)
    if below:
        dim = below[0]
        raise QuotaExceeded(
            f"project {project!r} holds {_shown(dim, used.get(dim))} {dim} and has carved out "
            f"{_shown(dim, reserved.get(dim))} for sub-projects: a quota of {_shown(dim, new.get(dim))} is too small",
            project=project,
            resource=dim,
            limit=_shown(dim, new.get(dim)),
            used=_shown(dim, used.get(dim)),
            reserved=_shown(dim, reserved.get(dim)),
            dimensions=below,
        )


def check_storage_fits(
    *, project: str, quota: int, used: int, reserved: int, want: int, what: str = "project"
) -> None:
    """Raise QuotaExceeded (resource ``storage``) unless ``used + reserved + want <= quota`` (bytes)."""
    if used + reserved + want <= quota:
        return
    raise QuotaExceeded(
        f"{what} {project!r} is over its storage quota: limit {quota} bytes, held by snapshots {used}, "
        f"carved out by sub-projects {reserved}, requested {want}; delete snapshots (`dsec snapshot rm`) "
        f"or have an ancestor's token raise it (PATCH /v1/projects/{project} with quota.storage)",
        project=project, resource="storage", limit=quota, used=used, reserved=reserved, requested=want,
        available=max(quota - used - reserved, 0), dimensions=["storage"],
    )


# ------------------------------------------------------------ row helpers ----


def quota_of(p: Project) -> Amount:
    return Amount(p.quota_sandboxes, p.quota_cpu_m, p.quota_memory)


def used_of(p: Project | Task) -> Amount:
    return Amount(p.used_sandboxes, p.used_cpu_m, p.used_memory)


def reserved_of(p: Project) -> Amount:
    return Amount(p.reserved_sandboxes, p.reserved_cpu_m, p.reserved_memory)


def task_quota_of(t: Task) -> TaskQuota:
    return TaskQuota(
        sandboxes=t.quota_sandboxes,
        cpu=None if t.quota_cpu_m is None else t.quota_cpu_m / 1000,
        memory=t.quota_memory,
    )


_PJ = PROJECTS
_TK = TASKS
def bump_statement(table: sa.Table, prefix: str, extra: tuple[str, ...] = ()) -> sa.Update:
    """``UPDATE table SET <prefix>_sandboxes += :b_n, <prefix>_cpu_m += :b_cpu,
    <prefix>_memory += :b_mem [, <prefix>_<x> += :b_<x>] WHERE id = :b_id``, built once."""
    params = {"sandboxes": "b_n", "cpu_m": "b_cpu", "memory": "b_mem", **{x: f"b_{x}" for x in extra}}
    return (
        sa.update(table)
        .where(table.c.id == sa.bindparam("b_id"))
        .values({f"{prefix}_{col}": table.c[f"{prefix}_{col}"] + sa.bindparam(bp) for col, bp in params.items()})
    )


_BUMP_PROJECT = bump_statement(_PJ, "used")
_BUMP_TASK = (  # what a task holds moves its active capacity alike (preemption moves that alone)
    sa.update(_TK)
    .where(_TK.c.id == sa.bindparam("b_id"))
    .values({f"{prefix}_{col}": _TK.c[f"{prefix}_{col}"] + sa.bindparam(bp)
             for prefix in ("used", "active")
             for col, bp in (("sandboxes", "b_n"), ("cpu_m", "b_cpu"), ("memory", "b_mem"))})
)
_BUMP_TASK_ACTIVE = bump_statement(_TK, "active")
_BUMP_RESERVED = bump_statement(_PJ, "reserved")
# Counters move by relative UPDATEs built once (statement construction dominates otherwise).
# ORM objects of these rows loaded earlier in the transaction do not see the change:
# re-read with lock_project() (populate_existing) when you need the new values.


def _bump(s: Session, stmt: sa.Update, row_id: int, delta: Amount) -> None:
    s.connection().execute(stmt, {"b_id": row_id, "b_n": delta.sandboxes, "b_cpu": delta.cpu_m, "b_mem": delta.memory})


def bump_project(s: Session, project_id: int, delta: Amount) -> None:
    if delta != Amount():
        _bump(s, _BUMP_PROJECT, project_id, delta)


def bump_task(s: Session, task_id: int | None, delta: Amount) -> None:
    """What the task holds (its quota's ``used``) and its active capacity move by ``delta``."""
    if task_id is not None and delta != Amount():
        _bump(s, _BUMP_TASK, task_id, delta)


def bump_task_active(s: Session, task_id: int | None, delta: Amount) -> None:
    """Only the task's active capacity moves (a sandbox paused by preemption, or resumed)."""
    if task_id is not None and delta != Amount():
        _bump(s, _BUMP_TASK_ACTIVE, task_id, delta)


def _bump_reserved(s: Session, project_id: int, delta: Amount) -> None:
    if delta != Amount():
        _bump(s, _BUMP_RESERVED, project_id, delta)


def lock_project(s: Session, project_id: int) -> Project:
    """The project row, locked for this transaction (SQLite: the write lock is already held).
    Callers look a project up by name first and lock after, parents before children (the
    lock order), so it may be gone by now: 404."""
    return lock_one(
        s, sa.select(Project).where(Project.id == project_id),
        lambda: NotFound(f"project #{project_id} no longer exists", project_id=project_id),
    )


# ---------------------------------------------------------------- callers ----


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a project token (acts for the project and its descendants)."""

    project_id: int
    project: str
    token_id: str
    is_root: bool


def new_token_secret() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def new_token_id() -> str:
    return "tok_" + secrets.token_hex(8)


def principal_for_token(s: Session, secret: str) -> Principal:
    if not secret.startswith(TOKEN_PREFIX):
        raise AuthError("not a project API token (expected 'Authorization: Bearer dsk_...')")
    row = s.execute(
        sa.select(ApiToken, Project).join(Project, Project.id == ApiToken.project_id)
        .where(ApiToken.hash == hash_api_token(secret))
    ).first()
    if row is None:
        raise AuthError("unknown API token")
    tok, proj = row
    if tok.revoked_at is not None:
        raise AuthError(f"API token {tok.id} was revoked", token_id=tok.id)
    return Principal(project_id=proj.id, project=proj.name, token_id=tok.id, is_root=proj.parent_id is None)


def subtree_ids(s: Session, root_id: int) -> list[int]:
    """``root_id`` and every descendant (one recursive query, both SQLite and PostgreSQL)."""
    tree = sa.select(Project.id).where(Project.id == root_id).cte("tree", recursive=True)
    tree = tree.union_all(sa.select(Project.id).where(Project.parent_id == tree.c.id))
    return list(s.execute(sa.select(tree.c.id)).scalars())


def ancestors(s: Session, project_id: int) -> list[int]:
    """``project_id`` and its ancestors up to the root, nearest first."""
    up = sa.select(Project.id, Project.parent_id).where(Project.id == project_id).cte("up", recursive=True)
    up = up.union_all(sa.select(Project.id, Project.parent_id).where(Project.id == up.c.parent_id))
    return list(s.execute(sa.select(up.c.id)).scalars())


def visible_project(s: Session, who: Principal, name: str, *, strict: bool = False) -> Project:
    """The project called ``name`` if the caller may act on it (``strict``: only below its own)."""
    p = s.execute(sa.select(Project).where(Project.name == name)).scalar_one_or_none()
    if p is None or who.project_id not in ancestors(s, p.id):
        raise NotFound(f"no project {name!r} under {who.project!r}", project=name)
    if strict and p.id == who.project_id:
        raise Forbidden(
            f"a project cannot change or delete itself: use a token of an ancestor of {name!r}", project=name
        )
    return p


def check_name(value: str, field: str) -> str:
    if not _NAME.match(value):
        raise InvalidSpec(
            f"{field} {value!r}: lowercase letters, digits and . _ - (max 63, starting with a letter or digit)",
            field=field,
        )
    return value


# --------------------------------------------------------------- projects ----


def project_info(s: Session, p: Project) -> ProjectInfo:
    parent = s.get(Project, p.parent_id) if p.parent_id is not None else None
    return ProjectInfo(
        name=p.name,
        parent=parent.name if parent else None,
        quota=quota_of(p).to_quota(),
        used=used_of(p).to_quota(),
        reserved=reserved_of(p).to_quota(),
        created_at=p.created_at,
    )


def bootstrap(
    s: Session, *, root: str, quota: Quota, token_secret: str | None, storage: int = 0
) -> tuple[Project, str | None]:
    """Make sure the root project exists with ``quota``; returns a new admin token if one was made.

    ``token_secret`` given: ensure that token exists for the root project.
    Not given: on the very first start (no token of the root at all) make one.
    """
    p = s.execute(sa.select(Project).where(Project.parent_id.is_(None), Project.name == root)).scalar_one_or_none()
    now = time.time()
    q = Amount.of_quota(quota)
    if p is None:
        if s.execute(sa.select(Project).where(Project.name == root)).scalar_one_or_none() is not None:
            raise Conflict(f"project {root!r} exists but is not a root project", project=root)
        p = Project(
            name=root, parent_id=None, created_at=now,
            quota_sandboxes=q.sandboxes, quota_cpu_m=q.cpu_m, quota_memory=q.memory,
            used_sandboxes=0, used_cpu_m=0, used_memory=0,
            reserved_sandboxes=0, reserved_cpu_m=0, reserved_memory=0,
            quota_storage=storage, used_storage=0, reserved_storage=0,
        )
        s.add(p)
        s.flush()
    else:
        p = lock_project(s, p.id)
        check_child_covers_itself(project=root, new=q, used=used_of(p), reserved=reserved_of(p))
        _check_storage_covers(p, storage)
        p.quota_sandboxes, p.quota_cpu_m, p.quota_memory = q.sandboxes, q.cpu_m, q.memory
        p.quota_storage = storage
    made: str | None = None
    if token_secret is not None:
        h = hash_api_token(token_secret)
        existing = s.execute(sa.select(ApiToken).where(ApiToken.hash == h)).scalar_one_or_none()
        if existing is None:
            s.add(ApiToken(id=new_token_id(), project_id=p.id, hash=h, name="bootstrap", created_at=now))
        elif existing.project_id != p.id:
            raise Conflict("bootstrap_token belongs to another project")
    elif s.execute(sa.select(sa.func.count()).select_from(ApiToken).where(ApiToken.project_id == p.id)).scalar_one() == 0:
        made = new_token_secret()
        s.add(ApiToken(id=new_token_id(), project_id=p.id, hash=hash_api_token(made), name="admin", created_at=now))
    return p, made


def _check_storage_covers(p: Project, new: int) -> None:
    if new < p.used_storage + p.reserved_storage:
        raise QuotaExceeded(
            f"project {p.name!r} holds {p.used_storage} bytes of snapshots and has carved out "
            f"{p.reserved_storage} for sub-projects: a storage quota of {new} is too small",
            project=p.name, resource="storage", limit=new, used=p.used_storage, reserved=p.reserved_storage,
            dimensions=["storage"],
        )


def _storage_of(quota: Quota) -> int | None:
    value = getattr(quota, "storage", None)
    return None if value is None else int(value)


def create_project(s: Session, who: Principal, name: str, parent: str | None, quota: Quota) -> ProjectInfo:
    """``quota`` may carry ``storage`` (bytes of snapshots, dsec.spec.control.ProjectQuota); default 0."""
    check_name(name, "name")
    par = visible_project(s, who, parent or who.project)
    if s.execute(sa.select(Project.id).where(Project.name == name)).first() is not None:
        raise Conflict(f"project {name!r} exists already", project=name)
    par = lock_project(s, par.id)
    new = Amount.of_quota(quota)
    check_child_quota(
        parent=par.name, parent_quota=quota_of(par), parent_used=used_of(par),
        parent_reserved=reserved_of(par), old=Amount(), new=new,
    )
    storage = _storage_of(quota) or 0
    check_storage_fits(
        project=par.name, quota=par.quota_storage, used=par.used_storage, reserved=par.reserved_storage,
        want=storage, what="parent project",
    )
    _bump_reserved(s, par.id, new)
    par.reserved_storage += storage
    p = Project(
        name=name, parent_id=par.id, created_at=time.time(),
        quota_sandboxes=new.sandboxes, quota_cpu_m=new.cpu_m, quota_memory=new.memory,
        used_sandboxes=0, used_cpu_m=0, used_memory=0,
        reserved_sandboxes=0, reserved_cpu_m=0, reserved_memory=0,
        quota_storage=storage, used_storage=0, reserved_storage=0,
    )
    if not add_new(s, p):  # the same name, made by a concurrent call since the check above
        raise Conflict(f"project {name!r} exists already", project=name)
    return project_info(s, p)


def update_project(s: Session, who: Principal, name: str, quota: Quota) -> ProjectInfo:
    p = visible_project(s, who, name, strict=True)
    assert p.parent_id is not None  # strict: the caller is a proper ancestor
    par = lock_project(s, p.parent_id)
    p = lock_project(s, p.id)
    new, old = Amount.of_quota(quota), quota_of(p)
    check_child_covers_itself(project=name, new=new, used=used_of(p), reserved=reserved_of(p))
    check_child_quota(
        parent=par.name, parent_quota=quota_of(par), parent_used=used_of(par),
        parent_reserved=reserved_of(par), old=old, new=new,
    )
    storage = _storage_of(quota)
    if storage is not None:
        _check_storage_covers(p, storage)
        check_storage_fits(
            project=par.name, quota=par.quota_storage, used=par.used_storage,
            reserved=par.reserved_storage - p.quota_storage, want=storage, what="parent project",
        )
        par.reserved_storage += storage - p.quota_storage
        p.quota_storage = storage
    _bump_reserved(s, par.id, new - old)
    p.quota_sandboxes, p.quota_cpu_m, p.quota_memory = new.sandboxes, new.cpu_m, new.memory
    s.flush()
    return project_info(s, p)


def delete_project(s: Session, who: Principal, name: str) -> None:
    p = visible_project(s, who, name, strict=True)
    assert p.parent_id is not None
    par = lock_project(s, p.parent_id)
    p = lock_project(s, p.id)
    if s.execute(sa.select(Project.id).where(Project.parent_id == p.id).limit(1)).first() is not None:
        raise Conflict(f"project {name!r} has sub-projects: delete them first", project=name)
    live = s.execute(
        sa.select(sa.func.count()).select_from(SandboxRow)
        .where(SandboxRow.project_id == p.id, SandboxRow.state != "stopped")
    ).scalar_one()
    if live:
        raise Conflict(f"project {name!r} still has {live} sandboxes: delete them first", project=name, sandboxes=live)
    snaps = s.execute(
        sa.select(sa.func.count()).select_from(SnapshotRow).where(SnapshotRow.project_id == p.id)
    ).scalar_one()
    if snaps:
        raise Conflict(
            f"project {name!r} still has {snaps} snapshots: delete them first (`dsec snapshot rm`)",
            project=name, snapshots=snaps,
        )
    _bump_reserved(s, par.id, Amount() - quota_of(p))
    par.reserved_storage -= p.quota_storage
    s.execute(sa.delete(SandboxRow).where(SandboxRow.project_id == p.id))
    s.execute(sa.delete(Task).where(Task.project_id == p.id))
    s.execute(sa.delete(ApiToken).where(ApiToken.project_id == p.id))
    s.execute(sa.delete(Project).where(Project.id == p.id))


def list_projects(s: Session, who: Principal) -> list[ProjectInfo]:
    ids = subtree_ids(s, who.project_id)
    rows = s.execute(sa.select(Project).where(Project.id.in_(ids)).order_by(Project.id)).scalars().all()
    names = {p.id: p.name for p in rows}
    return [
        ProjectInfo(
            name=p.name,
            parent=names.get(p.parent_id) if p.parent_id is not None else None,
            quota=quota_of(p).to_quota(),
            used=used_of(p).to_quota(),
            reserved=reserved_of(p).to_quota(),
            created_at=p.created_at,
        )
        for p in rows
    ]


# ----------------------------------------------------------------- tokens ----


def _token_info(t: ApiToken, project: str, secret: str | None = None) -> TokenInfo:
    return TokenInfo(
        id=t.id, project=project, name=t.name, created_at=t.created_at, revoked_at=t.revoked_at, token=secret
    )


def create_token(s: Session, who: Principal, project: str | None, name: str) -> TokenInfo:
    p = visible_project(s, who, project or who.project)
    secret = new_token_secret()
    t = ApiToken(id=new_token_id(), project_id=p.id, hash=hash_api_token(secret), name=name, created_at=time.time())
    if not add_new(s, t):  # (id and hash are random: the project was deleted since the lookup)
        raise NotFound(f"no project {p.name!r} under {who.project!r}", project=p.name)
    return _token_info(t, p.name, secret)


def revoke_token(s: Session, who: Principal, token_id: str) -> str:
    """Revoke (idempotent); returns the token's hash so caches can drop it."""
    row = s.execute(
        sa.select(ApiToken, Project).join(Project, Project.id == ApiToken.project_id).where(ApiToken.id == token_id)
    ).first()

    def gone() -> NotFound:
        return NotFound(f"no token {token_id!r} visible to project {who.project!r}", token_id=token_id)

    if row is None or who.project_id not in ancestors(s, row[1].id):
        raise gone()
    t = lock_one(s, sa.select(ApiToken).where(ApiToken.id == token_id), gone)  # its project's delete drops it
    if t.revoked_at is None:
        t.revoked_at = time.time()
    return t.hash


def list_tokens(s: Session, who: Principal) -> list[TokenInfo]:
    ids = subtree_ids(s, who.project_id)
    rows = s.execute(
        sa.select(ApiToken, Project.name).join(Project, Project.id == ApiToken.project_id)
        .where(ApiToken.project_id.in_(ids)).order_by(ApiToken.created_at)
    ).all()
    return [_token_info(t, name) for t, name in rows]


# ------------------------------------------------------------------ tasks ----


def _task_info(t: Task, project: str) -> TaskDetail:
    st = t.stages or {}
    return TaskDetail(
        name=t.name, project=project, quota=task_quota_of(t), used=used_of(t).to_quota(), created_at=t.created_at,
        stages={k: Stage.model_validate(v) for k, v in (st.get("stages") or {}).items()}, stage=st.get("stage"),
        **task_sched_fields(t),
    )


def task_sched_fields(t: Task) -> dict[str, Any]:
    """The scheduling part of a ``TaskDetail``."""
    mn = None
    if t.min_sandboxes is not None:
        mn = Amount(int(t.min_sandboxes), int(t.min_cpu_m or 0), int(t.min_memory or 0)).to_quota()
    active = Amount(int(t.active_sandboxes or 0), int(t.active_cpu_m or 0), int(t.active_memory or 0))
    return {"priority": int(t.priority if t.priority is not None else 200),
            "preemption": t.preemption or "pause", "min": mn,
            "burst": True if t.burst is None else bool(t.burst), "active": active.to_quota()}


def stages_doc(stages: dict[str, Stage], stage: str | None) -> dict[str, Any] | None:
    """What a task row keeps: the stages as JSON and the one new sandboxes start in."""
    if not stages:
        return None
    return {"stages": {k: v.model_dump(mode="json") for k, v in stages.items()}, "stage": stage or next(iter(stages))}


def _set_task_quota(t: Task, q: TaskQuota) -> None:
    lim = task_limit(q)
    t.quota_sandboxes, t.quota_cpu_m, t.quota_memory = lim["sandboxes"], lim["cpu"], lim["memory"]


def _task_raced(name: str) -> Conflict:
    return Conflict(f"task {name!r} could not be made: a concurrent call made it and it is gone again "
                    f"(or so is its project); retry", task=name)


def get_or_create_task(s: Session, project_id: int, name: str, *, lock: bool) -> Task:
    """The task ``name`` of the project, made on first use (no ceiling of its own)."""
    q = sa.select(Task).where(Task.project_id == project_id, Task.name == name)
    t = s.execute((q.with_for_update() if lock else q).execution_options(populate_existing=True)).scalar_one_or_none()
    if t is not None:
        return t
    t = Task(project_id=project_id, name=name, created_at=time.time(), used_sandboxes=0, used_cpu_m=0, used_memory=0)
    if add_new(s, t):
        return t
    # a concurrent first use of the same name (PostgreSQL): take theirs, unless it is gone again
    return lock_one(s, q, lambda: _task_raced(name))


def create_task(
    s: Session, who: Principal, name: str, quota: TaskQuota, *,
    stages: dict[str, Stage] | None = None, stage: str | None = None,
) -> TaskDetail:
    """Make a task, or set the quota (and, when given, the stages) of an existing one."""
    check_name(name, "name")
    q = sa.select(Task).where(Task.project_id == who.project_id, Task.name == name)
    existing = s.execute(q.with_for_update()).scalar_one_or_none()
    if existing is None:
        t = Task(project_id=who.project_id, name=name, created_at=time.time(), used_sandboxes=0, used_cpu_m=0,
                 used_memory=0)
        _set_task_quota(t, quota)
        if stages is not None:
            t.stages = stages_doc(stages, stage)
        if add_new(s, t):
            return _task_info(t, who.project)
        # a concurrent create of the same name committed first: set theirs, as below
        existing = lock_one(s, q, lambda: _task_raced(name))
    # PUT-like: creating an existing task sets its quota (a retried create is harmless)
    _set_task_quota(existing, quota)
    if stages is not None:
        existing.stages = stages_doc(stages, stage)
    return _task_info(existing, who.project)


def find_task(s: Session, who: Principal, name: str, *, lock: bool = False) -> Task:
    """The caller's task ``name``; ``lock``: taken for update by this very lookup (no gap in
    which a concurrent delete could take it between finding and locking)."""
    q = sa.select(Task).where(Task.project_id == who.project_id, Task.name == name)

    def gone() -> NotFound:
        return NotFound(f"no task {name!r} in project {who.project!r}", task=name)

    if lock:
        return lock_one(s, q, gone)
    t = s.execute(q).scalar_one_or_none()
    if t is None:
        raise gone()
    return t


def list_tasks(s: Session, who: Principal) -> list[TaskDetail]:
    ids = subtree_ids(s, who.project_id)
    rows = s.execute(
        sa.select(Task, Project.name).join(Project, Project.id == Task.project_id)
        .where(Task.project_id.in_(ids)).order_by(Task.created_at)
    ).all()
    return [_task_info(t, pname) for t, pname in rows]


def task_info(s: Session, who: Principal, name: str) -> TaskDetail:
    return _task_info(find_task(s, who, name), who.project)
