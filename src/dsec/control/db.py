"""The control plane's store: SQLAlchemy models, the engine, migrations.

All state of the control plane lives here, so API replicas are stateless and
several of them can share one PostgreSQL database. The default is an embedded
SQLite file in WAL mode with a busy timeout; write transactions on SQLite start
with ``BEGIN IMMEDIATE`` so two writers queue on the lock instead of failing
when a read snapshot would have to be upgraded.

The engine is synchronous; :class:`Store` runs each transaction in a small
thread pool, so the event loop never waits on the database. A transaction is a
plain function of a ``Session`` (no awaits inside): it commits when it returns
and rolls back when it raises. Write transactions that hit a lock timeout,
a deadlock or a serialization failure are retried a few times.

Counters (project/task usage, edge commitments) are kept on their rows and
updated in the same transaction as the sandbox rows that change them; the
watcher recomputes them from the sandbox rows now and then (see watcher.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from dsec.errors import Unavailable

log = logging.getLogger("dsec.control.db")

T = TypeVar("T")

MIGRATIONS = Path(__file__).with_name("migrations")
GROUP_MAX = 256
"""Most calls one group-commit transaction takes."""
_PG_MIGRATE_LOCK = 0x64736563  # "dsec": pg_advisory_xact_lock key serializing replicas' migrations


class Base(DeclarativeBase):
    pass


class Project(Base):
    __tablename__ = "projects"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(sa.String(63), unique=True)
    parent_id: Mapped[int | None] = mapped_column(sa.ForeignKey("projects.id"), index=True)
    created_at: Mapped[float] = mapped_column(sa.Double)
    # quota: cpu in millicores so sums are exact
    quota_sandboxes: Mapped[int] = mapped_column(sa.BigInteger)
    quota_cpu_m: Mapped[int] = mapped_column(sa.BigInteger)
    quota_memory: Mapped[int] = mapped_column(sa.BigInteger)
    # held by this project's own sandboxes (creating, running)
    used_sandboxes: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    used_cpu_m: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    used_memory: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    # carved out by the children (sum of their quotas)
    reserved_sandboxes: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    reserved_cpu_m: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    reserved_memory: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    # snapshot storage (bytes): its own quota, what its snapshots hold, carved out by children
    quota_storage: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")
    used_storage: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")
    reserved_storage: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    project_id: Mapped[int] = mapped_column(sa.ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    hash: Mapped[str] = mapped_column(sa.String(64), unique=True)
    name: Mapped[str] = mapped_column(sa.String(128), default="")
    created_at: Mapped[float] = mapped_column(sa.Double)
    revoked_at: Mapped[float | None] = mapped_column(sa.Double)


class Task(Base):
    __tablename__ = "tasks"
    __table_args__ = (sa.UniqueConstraint("project_id", "name", name="uq_tasks_project_name"),)

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    project_id: Mapped[int] = mapped_column(sa.ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(sa.String(63))
    created_at: Mapped[float] = mapped_column(sa.Double)
    quota_sandboxes: Mapped[int | None] = mapped_column(sa.BigInteger)
    quota_cpu_m: Mapped[int | None] = mapped_column(sa.BigInteger)
    quota_memory: Mapped[int | None] = mapped_column(sa.BigInteger)
    used_sandboxes: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    used_cpu_m: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    used_memory: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    stages: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON)
    """Declared stages (name -> ``dsec.spec.Stage`` as JSON) and the first one: ``{"stages": {...}, "stage": ...}``."""
    # scheduling (control/sched.py): the quota above is the task's max
    priority: Mapped[int] = mapped_column(sa.Integer, default=200, server_default="200")
    preemption: Mapped[str] = mapped_column(sa.String(8), default="pause", server_default="pause")
    """What may happen to the task's sandboxes when a more urgent create needs their room:
    ``pause`` (memory to swap, resumed later), ``destroy`` or ``never``."""
    burst: Mapped[bool] = mapped_column(sa.Boolean, default=True, server_default=sa.true())
    """Its creates may go to the burst pool above the utilisation threshold."""
    min_sandboxes: Mapped[int | None] = mapped_column(sa.BigInteger)
    min_cpu_m: Mapped[int | None] = mapped_column(sa.BigInteger)
    min_memory: Mapped[int | None] = mapped_column(sa.BigInteger)
    """The guaranteed minimum (reserved capacity), all three or none."""
    active_sandboxes: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")
    active_cpu_m: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")
    active_memory: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")
    """Capacity its sandboxes hold now: ``used`` less what preemption paused (memory in swap)."""


class SandboxRow(Base):
    """One sandbox. ``key`` exists from the reservation on; ``id`` once the edge answered."""

    __tablename__ = "sandboxes"
    __table_args__ = (
        sa.UniqueConstraint("project_id", "request_id", name="uq_sandboxes_project_request"),
        sa.Index("ix_sandboxes_project_state", "project_id", "state"),
        sa.Index("ix_sandboxes_edge_state", "edge_id", "state"),
        sa.Index("ix_sandboxes_edge_victims", "edge_id", "state", "priority", "created_at"),
    )

    key: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    id: Mapped[str | None] = mapped_column(sa.String(63), unique=True)
    edge_id: Mapped[str | None] = mapped_column(sa.String(16))
    edge_url: Mapped[str] = mapped_column(sa.String(512), default="")
    project_id: Mapped[int] = mapped_column(sa.ForeignKey("projects.id", ondelete="CASCADE"))
    task_id: Mapped[int | None] = mapped_column(sa.ForeignKey("tasks.id", ondelete="SET NULL"), index=True)
    task_name: Mapped[str | None] = mapped_column(sa.String(63))
    labels: Mapped[dict[str, str]] = mapped_column(sa.JSON, default=dict)
    state: Mapped[str] = mapped_column(sa.String(16), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    lifecycle: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    cpu_m: Mapped[int] = mapped_column(sa.BigInteger)
    memory: Mapped[int] = mapped_column(sa.BigInteger)
    disk: Mapped[int] = mapped_column(sa.BigInteger)
    created_at: Mapped[float] = mapped_column(sa.Double)
    updated_at: Mapped[float] = mapped_column(sa.Double, index=True)
    expires_at: Mapped[float | None] = mapped_column(sa.Double)
    request_id: Mapped[str | None] = mapped_column(sa.String(160))
    request_hash: Mapped[str] = mapped_column(sa.String(64), default="")
    reason: Mapped[str] = mapped_column(sa.Text, default="")
    launcher: Mapped[str | None] = mapped_column(sa.String(32))
    """The replica whose create made this reservation: if that replica dies before recording
    the edge's answer, the watcher finishes the create (watcher.py, "orphaned creates")."""
    priority: Mapped[int] = mapped_column(sa.Integer, default=200, server_default="200")
    """Its task's priority when it was made (preemption picks victims by it)."""
    preempted_at: Mapped[float | None] = mapped_column(sa.Double)
    """Set while it is paused by preemption: it holds its slot and disk on its edge, not its cpu
    and memory (the edge pushed those to swap). Cleared when it is resumed."""
    preemption: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON)
    """The last preemption (``dsec.spec.api.PreemptionInfo`` as JSON), shown to its owner."""


class SnapshotRow(Base):
    """A snapshot layer a project owns on one edge. ``size`` counts against the project's storage
    quota from the reservation on (an upper bound while ``creating``, the image's bytes once ``ready``)."""

    __tablename__ = "snapshots"
    __table_args__ = (sa.Index("ix_snapshots_edge_digest", "edge_id", "digest"),)

    key: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    project_id: Mapped[int] = mapped_column(sa.ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    edge_id: Mapped[str] = mapped_column(sa.String(16))
    sandbox_id: Mapped[str | None] = mapped_column(sa.String(63))
    state: Mapped[str] = mapped_column(sa.String(16))
    digest: Mapped[str | None] = mapped_column(sa.String(80))
    ref: Mapped[str] = mapped_column(sa.String(300), default="")
    size: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    parents: Mapped[list[str]] = mapped_column(sa.JSON, default=list)
    info: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON)
    created_at: Mapped[float] = mapped_column(sa.Double)
    updated_at: Mapped[float] = mapped_column(sa.Double)


class SchedEventRow(Base):
    """What the scheduler did (docs/CONTROL.md, "Scheduling"): a sandbox preempted (paused or
    destroyed) or resumed, with its project; the burst pool turned on or off, a burst node
    asked for or given back (no project: the operators' view)."""

    __tablename__ = "sched_events"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(sa.Double, index=True)
    project_id: Mapped[int | None] = mapped_column(sa.ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    task_name: Mapped[str | None] = mapped_column(sa.String(63))
    sandbox_id: Mapped[str | None] = mapped_column(sa.String(63))
    kind: Mapped[str] = mapped_column(sa.String(16))
    detail: Mapped[dict[str, Any]] = mapped_column(sa.JSON, default=dict)


class EdgeRow(Base):
    __tablename__ = "edges"

    id: Mapped[str] = mapped_column(sa.String(16), primary_key=True)
    url: Mapped[str] = mapped_column(sa.String(512))
    health: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON)
    registered_at: Mapped[float] = mapped_column(sa.Double)
    last_seen: Mapped[float | None] = mapped_column(sa.Double)
    status: Mapped[str] = mapped_column(sa.String(8), default="alive")
    misses: Mapped[int] = mapped_column(sa.Integer, default=0)
    draining: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    # what the control plane placed there (creating, running, stopping, failed)
    committed_sandboxes: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    committed_cpu_m: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    committed_memory: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    committed_disk: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    epoch: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")
    """Fencing epoch: raised when the edge's sandboxes are declared lost; the edge destroys
    what it made before it when it comes back (docs/CONTROL.md, "Fencing")."""
    lost_at: Mapped[float | None] = mapped_column(sa.Double)


class EdgeToken(Base):
    """Bootstrap tokens that let a new edge join (``dsec edge join URL --token dsb_...``)."""

    __tablename__ = "edge_tokens"

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    hash: Mapped[str] = mapped_column(sa.String(64), unique=True)
    name: Mapped[str] = mapped_column(sa.String(128), default="")
    created_at: Mapped[float] = mapped_column(sa.Double)
    expires_at: Mapped[float] = mapped_column(sa.Double)
    uses: Mapped[int | None] = mapped_column(sa.Integer)
    """Joins allowed; None: any number until it expires."""
    used: Mapped[int] = mapped_column(sa.Integer, default=0)
    revoked_at: Mapped[float | None] = mapped_column(sa.Double)


class Replica(Base):
    """Live control-plane replicas (each beats every second): a create whose replica stopped
    beating is finished by the watcher instead of waiting for its reservation to expire."""

    __tablename__ = "replicas"

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    url: Mapped[str] = mapped_column(sa.String(512), default="")
    started_at: Mapped[float] = mapped_column(sa.Double)
    seen_at: Mapped[float] = mapped_column(sa.Double)


class Lease(Base):
    """Leader election among replicas (the watcher runs in one of them)."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    holder: Mapped[str] = mapped_column(sa.String(64))
    expires_at: Mapped[float] = mapped_column(sa.Double)


class CreateLeaseRow(Base):
    """One edge's part of a create lease (docs/CONTROL.md, "Create leases"): the right to make up
    to ``granted`` sandboxes of one body on ``edge_id`` until ``expires_at``. Its unused slots are
    reservations (sandbox rows ``creating`` keyed ``<id><slot:08x>``) that hold the quota; a slot
    the edge used becomes that sandbox's row when the edge reports it."""

    __tablename__ = "create_leases"
    __table_args__ = (sa.Index("ix_create_leases_project_grant", "project_id", "grant_id"),)

    id: Mapped[str] = mapped_column(sa.String(24), primary_key=True)
    grant_id: Mapped[str] = mapped_column(sa.String(32))
    """The grant it is part of (one per ``POST /v1/leases``; releasing it releases every part)."""
    project_id: Mapped[int] = mapped_column(sa.ForeignKey("projects.id", ondelete="CASCADE"))
    token_id: Mapped[str | None] = mapped_column(sa.String(32), index=True)
    """The API token that asked for it: revoking the token revokes the lease."""
    request_id: Mapped[str | None] = mapped_column(sa.String(160))
    edge_id: Mapped[str] = mapped_column(sa.String(16))
    granted: Mapped[int] = mapped_column(sa.Integer)
    body: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    """The create body every sandbox of the lease is made from (as the edge gets it)."""
    state: Mapped[str] = mapped_column(sa.String(8), default="active", index=True)
    """``active``, then ``closed`` (expired, released or revoked: its unused slots returned)."""
    created_at: Mapped[float] = mapped_column(sa.Double)
    expires_at: Mapped[float] = mapped_column(sa.Double)
    closed_at: Mapped[float | None] = mapped_column(sa.Double)
    reason: Mapped[str] = mapped_column(sa.Text, default="")
    """Why it closed; while active, ``ahead`` marks a lease held ahead of creates (it yields)."""
    abandon: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON, nullable=True)
    """Set when the SDK abandoned the part (``POST /v1/leases/{grant}/abandon``): the request id,
    the digest of the slots it kept, and the decision's figures (a retried abandon is answered them)."""


# Core tables (the hot paths build statements once and bind parameters).
PROJECTS = Base.metadata.tables["projects"]
TASKS = Base.metadata.tables["tasks"]
SANDBOXES = Base.metadata.tables["sandboxes"]
SCHED_EVENTS = Base.metadata.tables["sched_events"]
SNAPSHOTS = Base.metadata.tables["snapshots"]
EDGES = Base.metadata.tables["edges"]


# ------------------------------------------------------------------ engine ----


def normalize_url(url: str) -> URL:
    """``postgresql://`` means psycopg 3 here (the only PostgreSQL driver we pin)."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u


def make_engine(url: str, *, pool_size: int = 8) -> Engine:
    u = normalize_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(
            u,
            connect_args={"timeout": 30.0, "check_same_thread": False},
            pool_size=pool_size,
            max_overflow=pool_size,
        )
        _sqlite_setup(engine)
        return engine
    return sa.create_engine(u, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)


def _sqlite_setup(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi: Any, _record: Any) -> None:
        dbapi.isolation_level = None  # we emit BEGIN ourselves (below)
        cur = dbapi.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; WAL keeps it consistent
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        write = conn.get_execution_options().get("dsec_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def _retryable(exc: DBAPIError) -> bool:
    text = str(exc.orig).lower() if exc.orig is not None else str(exc).lower()
    return any(
        s in text
        for s in ("database is locked", "deadlock detected", "could not serialize", "busy")
    )


def _disconnected(exc: BaseException) -> bool:
    """The database went away (restart, network, too many connections): not the query's fault."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).lower()
    return any(s in text for s in (
        "connection refused", "server closed the connection", "terminating connection", "connection failed",
        "the database system is starting up", "the database system is shutting down", "no such file or directory",
        "connection is closed", "consuming input failed", "connection timeout", "could not connect",
    ))


def unavailable(exc: BaseException) -> Unavailable | None:
    """The typed 503 for a store that cannot be reached now (clients retry it), or None."""
    if isinstance(exc, DBAPIError) and _disconnected(exc):
        return Unavailable(f"the control plane's store is unreachable now ({type(exc.orig or exc).__name__}); "
                           "retry shortly", retry_after=1.0, reason="store unavailable")
    return None


class _Careful(Exception):
    """A savepoint-less call hit a database error: run the group again, each call in a savepoint."""


class Store:
    """The engine plus a thread pool: ``await store.read(fn)`` / ``await store.write(fn)``."""

    def __init__(self, url: str, *, threads: int = 8) -> None:
        self.url = url
        self.engine = make_engine(url, pool_size=threads)
        self.dialect = self.engine.dialect.name
        self._write_engine = self.engine.execution_options(dsec_write=True)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dsec-db")
        self._pending: list[tuple[Callable[[Session], Any], bool, asyncio.Future[Any]]] = []
        self._flushing = False
        self._flusher: asyncio.Task[None] | None = None

    @property
    def is_sqlite(self) -> bool:
        return self.dialect == "sqlite"

    # -- transactions (sync, run in the pool) --

    @contextlib.contextmanager
    def session(self, *, write: bool) -> Iterator[Session]:
        with Session(self._write_engine if write else self.engine, expire_on_commit=False) as s, s.begin():
            yield s

    def run_sync(self, fn: Callable[[Session], T], *, write: bool) -> T:
        """One transaction. A write that hits a lock, deadlock or serialization failure is run
        again; a read is also run again (for up to ~2 s) when the database went away, a write is
        not (its commit may have happened): it raises :class:`Unavailable` (HTTP 503)."""
        attempts = 5 if write else 6
        for attempt in range(attempts):
            try:
                with self.session(write=write) as s:
                    return fn(s)
            except (OperationalError, DBAPIError) as exc:
                gone = _disconnected(exc)
                if gone and not write and attempt < attempts - 1:
                    log.info("store unreachable, reading again: %s", exc.orig)
                    time.sleep(0.05 * 2**attempt)
                    continue
                if attempt == attempts - 1 or not _retryable(exc) or gone:
                    u = unavailable(exc)
                    if u is not None:
                        raise u from exc
                    raise
                log.info("retrying a transaction after %s", exc.orig)
                time.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")

    async def read(self, fn: Callable[[Session], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: self.run_sync(fn, write=False))

    async def write(self, fn: Callable[[Session], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: self.run_sync(fn, write=True))

    # -- group commit --

    async def write_grouped(self, fn: Callable[[Session], T], *, checks_first: bool = False) -> T:
        """Like :meth:`write`, but concurrent calls share one transaction (group commit).

        Alone, a call runs at once; calls made while a group is being written
        form the next group. Each runs in its own savepoint, so one that raises
        fails alone and the others still commit. Under load this turns N
        transactions (N lock waits, N commits) into one.

        ``checks_first``: ``fn`` only raises (other than a database error)
        before its first write, so it needs no savepoint (two round trips
        fewer on PostgreSQL). A database error in such a call re-runs the
        whole group with savepoints.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((fn, checks_first, fut))
        if not self._flushing:
            self._flushing = True
            self._flusher = loop.create_task(self._flush())
        return await fut  # type: ignore[no-any-return]

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                group, self._pending = self._pending[:GROUP_MAX], self._pending[GROUP_MAX:]
                calls = [(fn, checks_first) for fn, checks_first, _ in group]
                try:
                    results = await loop.run_in_executor(self._pool, self._run_group, calls)
                except BaseException as exc:  # the commit itself failed: everyone of the group hears it
                    results = [(False, unavailable(exc) or exc)] * len(group)
                for (_, _, fut), (ok, value) in zip(group, results, strict=True):
                    if fut.done():
                        continue
                    if ok:
                        fut.set_result(value)
                    else:
                        fut.set_exception(value)
        finally:
            self._flushing = False

    def _run_group(self, calls: list[tuple[Callable[[Session], Any], bool]]) -> list[tuple[bool, Any]]:
        if len(calls) == 1:
            try:
                return [(True, self.run_sync(calls[0][0], write=True))]
            except Exception as exc:
                return [(False, exc)]
        attempts = 5
        careful = False  # True: a savepoint for every call
        for attempt in range(attempts):
            try:
                out: list[tuple[bool, Any]] = []
                with self.session(write=True) as s:
                    for fn, checks_first in calls:
                        if checks_first and not careful:
                            try:
                                out.append((True, fn(s)))
                            except DBAPIError as exc:
                                if _disconnected(exc):
                                    raise  # the store went away: see below
                                raise _Careful from None
                            except Exception as exc:
                                out.append((False, exc))
                            continue
                        try:
                            with s.begin_nested():
                                out.append((True, fn(s)))
                        except DBAPIError as exc:
                            # the store went away: the connection is gone with the whole group's
                            # work, so every call hears it (a 503), not only this one (the next
                            # calls and the commit would fail with PendingRollbackError, a 500)
                            if _retryable(exc) or _disconnected(exc):
                                raise  # the whole group again
                            out.append((False, exc))
                        except Exception as exc:
                            out.append((False, exc))
                return out
            except _Careful:
                careful = True
            except DBAPIError as exc:
                if attempt == attempts - 1 or not _retryable(exc) or _disconnected(exc):
                    raise
                log.info("retrying a group of %d after %s", len(calls), exc.orig)
                time.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")

    # -- lifecycle --

    def migrate(self) -> None:
        """Bring the schema to the newest revision (alembic), once even with many replicas."""
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        with self._migrate_lock(), self._write_engine.begin() as conn:
            if self.dialect == "postgresql":
                conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_MIGRATE_LOCK})")
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    @contextlib.contextmanager
    def _migrate_lock(self) -> Iterator[None]:
        """SQLite: a file lock beside the database (two processes starting at once)."""
        u = normalize_url(self.url)
        if not self.is_sqlite or not u.database or u.database == ":memory:":
            yield
            return
        with open(f"{u.database}.migrate.lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def schema_revision(self) -> str | None:
        with self.engine.connect() as conn:
            try:
                return conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
            except DBAPIError:
                return None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
        self.engine.dispose()
