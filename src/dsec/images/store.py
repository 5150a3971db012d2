"""Layer stores: where immutable, content-addressed EROFS layers live.

:class:`LayerStore` is the interface the rest of DSec codes against. Nothing
outside a store may assume a layer is a local file: callers that need a path
(to mount it) ask :meth:`LayerStore.open_local`, which a lazily fetched remote
store answers with a FUSE-backed path. :class:`LocalLayerStore` keeps layers on
local disk::

    <root>/index.db                  sqlite (WAL): layers, tags, pins
    <root>/blobs/sha256/<hex>.erofs  one file per layer, mode 0444
    <root>/tmp/                      scratch: builds and imports in progress

A layer may also be *remote*: its index rows and its chunk table are here, its bytes
are in an OCI registry (``remotes`` table, :meth:`LocalLayerStore.add_remote`). Such a
layer is mounted from a path a :class:`RemoteSource` (the node's lazy loader, set with
:meth:`LocalLayerStore.set_remote_source`) gives :meth:`~LayerStore.open_local`, and a
name:tag the store does not know is looked up there before :class:`LayerNotFound`.

Every write that adds or removes a blob happens inside an sqlite write
transaction, so a concurrent ``add``/``remove``/``pin`` of the same digest in
another thread or process is serialised. Files are written to ``tmp/`` and
renamed into place, so a crash never leaves a half-written blob under its
digest; scratch left by dead processes is removed when a store is opened.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import dataclasses
import fcntl
import json
import os
import secrets
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dsec.errors import ImageError, InvalidSpec, LayerInUse, LayerNotFound, LayerUnavailable

from .erofs import is_erofs
from .fsutil import CHUNK, fsync_dir, remove_tree, sha256_file
from .layer import (
    DIGEST_PREFIX,
    Layer,
    LayerKind,
    check_digest,
    check_kind,
    check_name,
    check_tag,
    digest_hex,
    parse_ref,
)

if TYPE_CHECKING:
    from .lazy.model import RemoteLayer

_SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS layers (
    digest     TEXT PRIMARY KEY,
    kind       TEXT NOT NULL,
    size       INTEGER NOT NULL,
    created_at REAL NOT NULL,
    parents    TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tags (
    name       TEXT NOT NULL,
    tag        TEXT NOT NULL,
    digest     TEXT NOT NULL REFERENCES layers(digest),
    updated_at REAL NOT NULL,
    PRIMARY KEY (name, tag, digest)
);
CREATE INDEX IF NOT EXISTS tags_by_digest ON tags(digest);
CREATE TABLE IF NOT EXISTS remotes (
    digest     TEXT PRIMARY KEY REFERENCES layers(digest) ON DELETE CASCADE,
    registry   TEXT NOT NULL,
    repo       TEXT NOT NULL,
    chunk_size INTEGER NOT NULL,
    chunks     TEXT NOT NULL,
    lazy       TEXT
);
CREATE TABLE IF NOT EXISTS pins (
    digest    TEXT NOT NULL,
    holder    TEXT NOT NULL,
    pinned_at REAL NOT NULL,
    PRIMARY KEY (digest, holder)
);
"""

_LIST_HINT = "see available layers with `dsec image ls`"


@dataclasses.dataclass(frozen=True)
class RemoteRecord:
    """What the store knows of a remote layer: the EROFS file in the registry (``layer``,
    digest = the layer's) and, when the push made one, its lazy form: the metadata image
    (``meta``) and data device (``data``), each a blob with its own chunk table."""

    layer: RemoteLayer
    meta: RemoteLayer | None = None
    data: RemoteLayer | None = None


@dataclasses.dataclass(frozen=True)
class MountSource:
    """How to mount a layer: EROFS from ``path``, with mount ``options`` (``device=...``
    for a lazy form's data device) or none."""

    path: Path
    options: str | None = None


class RemoteSource(Protocol):
    """Where a store's remote layers come from: the node's registry and lazy loader
    (:class:`dsec.images.remote.RegistryLayers`). Blocking calls."""

    def lookup(self, name: str, tag: str) -> Layer | None:
        """Find ``name:tag`` in the registry and register it in the store as a remote layer
        (:meth:`LocalLayerStore.add_remote`); None when the registry does not have it.
        Raises :class:`LayerUnavailable` when the registry cannot be asked."""

    def describe(self, name: str, tag: str) -> str:
        """Where ``name:tag`` was looked for, for error messages."""

    def attach(self, remote: RemoteRecord) -> MountSource:
        """Local files to mount the layer from (lazily loaded). Raises
        :class:`LayerUnavailable` when its metadata cannot be fetched."""

    def detach(self, digest: str) -> None:
        """The layer's path is no longer used (its mount is gone); a no-op if not attached."""
_SCRATCH_GRACE_S = 60.0


class LayerStore(abc.ABC):
    """A set of immutable layers, addressed by digest and named by ``name:tag``.

    Every layer has at least one ``name:tag``; several digests may share one,
    and ``name:tag`` then resolves to the one stored (or re-tagged) last. A
    digest that is pinned by any holder (a sandbox, a mount) cannot be removed.
    """

    @abc.abstractmethod
    def resolve(self, ref: str) -> Layer:
        """``NAME[:TAG]`` -> latest layer with it; ``sha256:<hex or prefix>`` -> that layer."""

    @abc.abstractmethod
    def get(self, digest: str) -> Layer:
        """The layer with this full digest (under its most recent name:tag)."""

    @abc.abstractmethod
    def list(self) -> builtins.list[Layer]:
        """Every (layer, name:tag) pair, sorted by name, tag, newest first."""

    @abc.abstractmethod
    def remove(self, ref: str) -> None:
        """Remove what ``ref`` resolves to (a digest: the layer; a name:tag: that tag).

        A layer whose last name goes is deleted and its disk freed. Raises
        LayerInUse if the layer is pinned, LayerNotFound if ``ref`` is unknown.
        """

    @abc.abstractmethod
    def add_erofs(
        self,
        path: Path,
        *,
        name: str,
        tag: str,
        kind: LayerKind | str,
        parents: Iterable[str] = (),
        consume: bool = False,
    ) -> Layer:
        """Import an existing EROFS image file; idempotent for identical content.

        With ``consume=True`` the store may move ``path`` instead of copying it
        (builders pass their scratch output this way).
        """

    @abc.abstractmethod
    def open_local(self, digest: str) -> Path:
        """A local path whose bytes are the layer's EROFS image, for mounting."""

    def mount_source(self, digest: str) -> MountSource:
        """What to mount the layer from: :meth:`open_local`'s file unless the store loads
        the layer another way (a remote layer's lazy form: a metadata image and its data
        device)."""
        return MountSource(self.open_local(digest))

    @abc.abstractmethod
    def pin(self, digest: str, holder: str) -> bool:
        """Record that ``holder`` uses ``digest``; idempotent. LayerNotFound if unknown.

        Returns True if the pin is new, False if ``holder`` already had it.
        """

    @abc.abstractmethod
    def unpin(self, digest: str, holder: str) -> None:
        """Drop one pin; dropping a pin that does not exist is fine."""

    @abc.abstractmethod
    def holders(self, digest: str) -> set[str]:
        """Who pins ``digest`` now."""

    @abc.abstractmethod
    def unpin_all_except(self, alive_holders: set[str]) -> int:
        """Drop pins of holders not in ``alive_holders`` (reconcile after a crash).

        Returns how many pins were dropped.
        """

    def dependents(self, digest: str) -> builtins.list[str]:
        """Snapshot layers whose lineage includes ``digest`` (it cannot be removed before them)."""
        return []

    def release_local(self, digest: str) -> None:  # noqa: B027 - optional hook, no-op by default
        """The path :meth:`open_local` gave for ``digest`` is no longer mounted: a store that
        made it on demand (a lazily loaded remote layer) may let it go."""

    @abc.abstractmethod
    def scratch(self, purpose: str = "build") -> contextlib.AbstractContextManager[Path]:
        """A private, empty, local directory for a build; deleted (with all content) on exit."""


class LocalLayerStore(LayerStore):
    """Layers as files under ``root`` with an sqlite index; see the module docstring."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()
        self.blob_dir = self.root / "blobs" / "sha256"
        self.tmp_dir = self.root / "tmp"
        self.index_path = self.root / "index.db"
        self._local = threading.local()
        self._source: RemoteSource | None = None
        try:
            self.blob_dir.mkdir(parents=True, exist_ok=True)
            self.tmp_dir.mkdir(mode=0o700, exist_ok=True)
        except OSError as e:
            raise ImageError(
                f"cannot create the layer store at {self.root}: {e.strerror}; "
                "choose a writable directory (set DSEC_STATE_DIR)",
                path=str(self.root),
            ) from e
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            if db.execute("PRAGMA user_version").fetchone()[0] != _SCHEMA_VERSION:
                db.executescript(_SCHEMA)
                db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        self._clean_dead_scratch()

    def __repr__(self) -> str:
        return f"LocalLayerStore({str(self.root)!r})"

    # -- sqlite plumbing ---------------------------------------------------

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection to the index, kept open.

        Kept open on purpose: closing the last connection to a WAL database
        checkpoints it, which made every pin cost milliseconds. A forked child
        opens its own (an sqlite connection must not cross fork()).
        """
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None or self._local.pid != os.getpid():
            db = sqlite3.connect(
                self.index_path, timeout=30.0, isolation_level=None, check_same_thread=True
            )
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA foreign_keys=ON")
            self._local.db, self._local.pid = db, os.getpid()
        yield db

    def close(self) -> None:
        """Close this thread's index connection (others close when their thread ends)."""
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is not None and self._local.pid == os.getpid():
            db.close()
        self._local.db = None

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction: holds the index's write lock until commit."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def blob_path(self, digest: str) -> Path:
        return self.blob_dir / f"{digest_hex(digest)}.erofs"

    @staticmethod
    def _layer(row: tuple[str, str, str, str, int, float, str, str | None, str | None]) -> Layer:
        digest, name, tag, kind, size, created_at, parents, registry, repo = row
        return Layer(
            digest=digest,
            name=name,
            tag=tag,
            kind=LayerKind(kind),
            size=size,
            created_at=created_at,
            parents=tuple(json.loads(parents)),
            source=f"{registry}/{repo}" if registry is not None else None,
        )

    _SELECT = (
        "SELECT l.digest, t.name, t.tag, l.kind, l.size, l.created_at, l.parents, r.registry, r.repo "
        "FROM layers l JOIN tags t ON t.digest = l.digest LEFT JOIN remotes r ON r.digest = l.digest "
    )

    # -- lookups -------------------------------------------------------------

    def get(self, digest: str) -> Layer:
        check_digest(digest)
        with self._connect() as db:
            row = db.execute(
                self._SELECT
                + "WHERE l.digest = ? ORDER BY t.updated_at DESC, t.rowid DESC LIMIT 1",
                (digest,),
            ).fetchone()
        if row is None:
            raise LayerNotFound(f"no layer {digest} in {self.root}: {_LIST_HINT}", ref=digest)
        return self._layer(row)

    def resolve(self, ref: str) -> Layer:
        parsed = parse_ref(ref)
        if parsed.digest_hex is not None:
            if parsed.is_full_digest:
                return self.get(DIGEST_PREFIX + parsed.digest_hex)
            with self._connect() as db:
                rows = db.execute(
                    "SELECT digest FROM layers WHERE digest >= ? AND digest < ? LIMIT 3",
                    (DIGEST_PREFIX + parsed.digest_hex, DIGEST_PREFIX + parsed.digest_hex + "g"),
                ).fetchall()
            if not rows:
                raise LayerNotFound(f"no layer matches {ref} in {self.root}: {_LIST_HINT}", ref=ref)
            if len(rows) > 1:
                raise InvalidSpec(
                    f"{ref} is ambiguous: it matches several layers; give more hex digits",
                    field="ref",
                )
            return self.get(rows[0][0])
        with self._connect() as db:
            row = db.execute(
                self._SELECT + "WHERE t.name = ? AND t.tag = ? "
                "ORDER BY t.updated_at DESC, t.rowid DESC LIMIT 1",
                (parsed.name, parsed.tag),
            ).fetchone()
            if row is None:
                others = [
                    r[0]
                    for r in db.execute(
                        "SELECT DISTINCT tag FROM tags WHERE name = ? ORDER BY tag", (parsed.name,)
                    )
                ]
        if row is not None:
            return self._layer(row)
        source = self._source
        assert parsed.name is not None and parsed.tag is not None  # not a digest: a name and a tag
        if source is not None:
            found = source.lookup(parsed.name, parsed.tag)
            if found is not None:
                return found
        hint = f" (tags of {parsed.name}: {', '.join(others)})" if others else ""
        where = f" nor {source.describe(parsed.name, parsed.tag)}" if source is not None else ""
        raise LayerNotFound(
            f"no layer {parsed.name}:{parsed.tag} in {self.root}{hint}{where}: {_LIST_HINT}", ref=ref
        )

    def list(self) -> builtins.list[Layer]:
        with self._connect() as db:
            rows = db.execute(self._SELECT + "ORDER BY t.name, t.tag, t.updated_at DESC").fetchall()
        return [self._layer(r) for r in rows]

    def open_local(self, digest: str) -> Path:
        self.get(digest)
        path = self.blob_path(digest)
        if not path.is_file() and (rec := self.remote(digest)) is not None:
            source = self._source
            if source is None:
                raise self._no_loader(rec)
            found = source.attach(dataclasses.replace(rec, meta=None, data=None))
            return found.path
        if not path.is_file():
            raise ImageError(
                f"layer {digest} is in the index of {self.root} but its file {path} is missing; "
                f"remove it (`dsec image rm {digest}`) and build or import it again",
                digest=digest,
            )
        return path

    def mount_source(self, digest: str) -> MountSource:
        self.get(digest)
        if not self.blob_path(digest).is_file() and (rec := self.remote(digest)) is not None:
            if self._source is None:
                raise self._no_loader(rec)
            return self._source.attach(rec)
        return MountSource(self.open_local(digest))

    def _no_loader(self, rec: RemoteRecord) -> LayerUnavailable:
        r = rec.layer
        return LayerUnavailable(
            f"layer {r.digest} is a registry layer ({r.registry}/{r.repo}) and this process has no lazy "
            "loader: run it on an edge with a registry configured, or fetch the whole layer with "
            f"`dsec image pull {_host(r.registry)}/{r.repo}:sha256-{digest_hex(r.digest)}`",
            digest=r.digest, registry=r.registry, status=0,
        )  # fmt: skip

    # -- remote layers ---------------------------------------------------------

    def set_remote_source(self, source: RemoteSource | None) -> None:
        """Where remote layers' bytes and unknown names come from (None: nowhere)."""
        self._source = source

    @property
    def remote_source(self) -> RemoteSource | None:
        return self._source

    def remote(self, digest: str) -> RemoteRecord | None:
        """The registry location and chunk tables of a remote layer (no auth headers);
        None for a layer held as a local file only, or unknown."""
        from .lazy.model import RemoteLayer

        check_digest(digest)
        with self._connect() as db:
            row = db.execute(
                "SELECT r.registry, r.repo, r.chunk_size, r.chunks, l.size, r.lazy FROM remotes r "
                "JOIN layers l ON l.digest = r.digest WHERE r.digest = ?", (digest,),
            ).fetchone()  # fmt: skip
        if row is None:
            return None
        registry, repo, chunk_size, chunks, size, lazy = row
        layer = RemoteLayer(registry=registry, repo=repo, digest=digest, size=size, chunk_size=chunk_size,
                            chunks=tuple(json.loads(chunks)))  # fmt: skip
        if not lazy:
            return RemoteRecord(layer)
        meta, data = (RemoteLayer(registry=registry, repo=repo, **part) for part in json.loads(lazy))
        return RemoteRecord(layer, meta, data)

    def add_remote(
        self, remote: RemoteLayer, *, name: str, tag: str, kind: LayerKind | str, parents: Iterable[str] = (),
        lazy: tuple[RemoteLayer, RemoteLayer] | None = None,
    ) -> Layer:
        """Register a layer whose bytes stay in a registry (``remote``: where, and its chunk
        table) under ``name:tag``; idempotent. A layer already held as a file keeps its file
        (it is then also known to be in the registry). ``lazy``: the layer's lazy form in the
        same repository, (metadata image, data device)."""
        check_name(name)
        check_tag(tag)
        kind = check_kind(kind)
        parent_list = [check_digest(p) for p in parents]
        digest, now = remote.digest, time.time()
        with self._write() as db:
            row = db.execute("SELECT kind, created_at, parents, size FROM layers WHERE digest = ?",
                             (digest,)).fetchone()  # fmt: skip
            if row is not None and (row[0] != kind.value or row[3] != remote.size):
                raise ImageError(
                    f"layer {digest} is stored as a {row[0]} layer of {row[3]} bytes; the registry "
                    f"{remote.registry}/{remote.repo} describes a {kind.value} layer of {remote.size} bytes",
                    digest=digest,
                )  # fmt: skip
            if row is None:
                db.execute("INSERT INTO layers(digest, kind, size, created_at, parents) VALUES (?, ?, ?, ?, ?)",
                           (digest, kind.value, remote.size, now, json.dumps(parent_list)))  # fmt: skip
                created_at, stored_parents = now, parent_list
            else:
                created_at, stored_parents = row[1], json.loads(row[2])
            lazy_json = None if lazy is None else json.dumps([
                {"digest": p.digest, "size": p.size, "chunk_size": p.chunk_size, "chunks": list(p.chunks),
                 "encoding": p.encoding, "offsets": list(p.offsets), "prefetch": [list(r) for r in p.prefetch], "extents": p.extents}
                for p in lazy])  # fmt: skip
            db.execute(
                "INSERT INTO remotes(digest, registry, repo, chunk_size, chunks, lazy) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(digest) DO UPDATE SET registry = excluded.registry, repo = excluded.repo, "
                "lazy = excluded.lazy",
                (digest, remote.registry, remote.repo, remote.chunk_size, json.dumps(list(remote.chunks)), lazy_json),
            )
            db.execute(
                "INSERT INTO tags(name, tag, digest, updated_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(name, tag, digest) DO UPDATE SET updated_at = excluded.updated_at",
                (name, tag, digest, now),
            )
        return Layer(digest=digest, name=name, tag=tag, kind=kind, size=remote.size, created_at=created_at,
                     parents=tuple(stored_parents), source=f"{remote.registry}/{remote.repo}")  # fmt: skip

    def release_local(self, digest: str) -> None:
        source = self._source
        if source is not None and not self.blob_path(digest).is_file():
            source.detach(digest)

    # -- adding ----------------------------------------------------------------

    def add_erofs(
        self,
        path: Path,
        *,
        name: str,
        tag: str,
        kind: LayerKind | str,
        parents: Iterable[str] = (),
        consume: bool = False,
    ) -> Layer:
        path = Path(path)
        check_name(name)
        check_tag(tag)
        kind = check_kind(kind)
        parent_list = [check_digest(p) for p in parents]
        if not path.is_file():
            raise ImageError(f"cannot import {path}: no such file", path=str(path))
        if not is_erofs(path):
            raise ImageError(
                f"cannot import {path}: it is not an EROFS image (no EROFS superblock); "
                "build one with `dsec image build --from-dir DIR`",
                path=str(path),
            )
        with self._stage_blob(path, consume=consume) as staged:
            hexd, size = sha256_file(staged)
            digest = DIGEST_PREFIX + hexd
            now = time.time()
            with self._write() as db:
                row = db.execute(
                    "SELECT kind, created_at, parents FROM layers WHERE digest = ?", (digest,)
                ).fetchone()
                if row is not None and row[0] != kind.value:
                    existing = db.execute(
                        "SELECT name || ':' || tag FROM tags WHERE digest = ? LIMIT 1", (digest,)
                    ).fetchone()
                    raise ImageError(
                        f"identical content is already stored as a {row[0]} layer "
                        f"({existing[0] if existing else digest}); a layer has one kind: "
                        f"import it with --kind {row[0]}",
                        digest=digest,
                    )
                target = self.blob_path(digest)
                if row is None or not target.is_file():
                    os.chmod(staged, 0o444)
                    os.replace(staged, target)
                    fsync_dir(self.blob_dir)
                if row is None:
                    db.execute(
                        "INSERT INTO layers(digest, kind, size, created_at, parents) "
                        "VALUES (?, ?, ?, ?, ?)",
                        (digest, kind.value, size, now, json.dumps(parent_list)),
                    )
                    created_at, stored_parents = now, parent_list
                else:
                    # Same bytes, same layer: its first record (time, lineage) stands.
                    created_at, stored_parents = row[1], json.loads(row[2])
                db.execute(
                    "INSERT INTO tags(name, tag, digest, updated_at) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(name, tag, digest) DO UPDATE SET updated_at = excluded.updated_at",
                    (name, tag, digest, now),
                )
        return Layer(
            digest=digest,
            name=name,
            tag=tag,
            kind=kind,
            size=size,
            created_at=created_at,
            parents=tuple(stored_parents),
        )

    @contextlib.contextmanager
    def _stage_blob(self, path: Path, *, consume: bool) -> Iterator[Path]:
        """Put the bytes of ``path`` at a fresh, locked name in tmp/ (same filesystem as blobs/).

        The file is flock()ed while staged, which tells the scratch cleaner of
        other processes (maybe in other pid namespaces) that it is in use.
        Whatever is still there on exit is deleted.
        """
        staged = self.tmp_dir / f"import-{os.getpid()}-{secrets.token_hex(6)}.erofs"
        fd = -1
        try:
            if consume:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    fcntl.flock(fd, fcntl.LOCK_EX)  # the lock follows the inode
                    os.rename(path, staged)
                except OSError:
                    if fd >= 0:
                        os.close(fd)
                        fd = -1
            if fd < 0:
                fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX)
                with open(path, "rb") as src, open(fd, "wb", closefd=False) as dst:
                    shutil.copyfileobj(src, dst, CHUNK)
                    dst.flush()
                    os.fsync(fd)
                if consume:
                    path.unlink(missing_ok=True)
            yield staged
        finally:
            staged.unlink(missing_ok=True)
            if fd >= 0:
                os.close(fd)

    # -- removing ----------------------------------------------------------------

    def remove(self, ref: str) -> None:
        layer = self.resolve(ref)
        parsed = parse_ref(ref)
        trash: Path | None = None
        with self._write() as db:
            if (
                db.execute("SELECT 1 FROM layers WHERE digest = ?", (layer.digest,)).fetchone()
                is None
            ):
                raise LayerNotFound(f"no layer {ref!r} in {self.root}: {_LIST_HINT}", ref=ref)
            pins = [
                r[0]
                for r in db.execute("SELECT holder FROM pins WHERE digest = ?", (layer.digest,))
            ]
            if pins:
                shown = ", ".join(sorted(pins)[:5]) + (" ..." if len(pins) > 5 else "")
                raise LayerInUse(
                    f"layer {layer.ref} ({layer.digest}) is in use by {len(pins)} holder(s): "
                    f"{shown}; stop those sandboxes first",
                    digest=layer.digest,
                    holders=sorted(pins),
                )
            if parsed.is_digest:
                db.execute("DELETE FROM tags WHERE digest = ?", (layer.digest,))
            else:
                db.execute(
                    "DELETE FROM tags WHERE name = ? AND tag = ? AND digest = ?",
                    (parsed.name, parsed.tag, layer.digest),
                )
            left = db.execute(
                "SELECT COUNT(*) FROM tags WHERE digest = ?", (layer.digest,)
            ).fetchone()[0]
            if left == 0:
                deps = self._dependents(db, layer.digest)
                if deps:
                    # A snapshot is a diff over its lineage: without it the snapshot is garbage.
                    shown = ", ".join(deps[:5]) + (" ..." if len(deps) > 5 else "")
                    raise LayerInUse(
                        f"layer {layer.ref} ({layer.digest}) lies beneath {len(deps)} snapshot(s): "
                        f"{shown}; remove those first",
                        digest=layer.digest,
                        holders=[f"snapshot:{d}" for d in deps],
                    )
                db.execute("DELETE FROM layers WHERE digest = ?", (layer.digest,))
                blob = self.blob_path(layer.digest)
                if blob.exists():
                    trash = self.tmp_dir / f"trash-{os.getpid()}-{secrets.token_hex(6)}.erofs"
                    os.rename(blob, trash)
        if trash is not None:
            trash.unlink(missing_ok=True)

    @staticmethod
    def _dependents(db: sqlite3.Connection, digest: str) -> builtins.list[str]:
        rows = db.execute(
            "SELECT digest, parents FROM layers WHERE kind = ? AND parents LIKE ?",
            (LayerKind.SNAPSHOT.value, f'%"{digest}"%'),
        ).fetchall()
        return sorted(d for d, parents in rows if digest in json.loads(parents))

    def dependents(self, digest: str) -> builtins.list[str]:
        check_digest(digest)
        with self._connect() as db:
            return self._dependents(db, digest)

    # -- pins ----------------------------------------------------------------

    def pin(self, digest: str, holder: str) -> bool:
        check_digest(digest)
        if not holder:
            raise InvalidSpec("a pin holder must be a non-empty string", field="holder")
        with self._write() as db:
            if db.execute("SELECT 1 FROM layers WHERE digest = ?", (digest,)).fetchone() is None:
                raise LayerNotFound(
                    f"cannot pin {digest}: no such layer in {self.root}: {_LIST_HINT}", ref=digest
                )
            cur = db.execute(
                "INSERT OR IGNORE INTO pins(digest, holder, pinned_at) VALUES (?, ?, ?)",
                (digest, holder, time.time()),
            )
            return cur.rowcount == 1

    def unpin(self, digest: str, holder: str) -> None:
        check_digest(digest)
        with self._write() as db:
            db.execute("DELETE FROM pins WHERE digest = ? AND holder = ?", (digest, holder))

    def holders(self, digest: str) -> set[str]:
        check_digest(digest)
        with self._connect() as db:
            return {r[0] for r in db.execute("SELECT holder FROM pins WHERE digest = ?", (digest,))}

    def unpin_all_except(self, alive_holders: set[str]) -> int:
        with self._write() as db:
            rows = db.execute("SELECT rowid, holder FROM pins").fetchall()
            dead = [rowid for rowid, holder in rows if holder not in alive_holders]
            db.executemany("DELETE FROM pins WHERE rowid = ?", [(r,) for r in dead])
        return len(dead)

    # -- scratch and housekeeping ----------------------------------------------

    @contextlib.contextmanager
    def _scratch(self, purpose: str) -> Iterator[Path]:
        path = self.tmp_dir / f"{purpose}-{os.getpid()}-{secrets.token_hex(6)}"
        path.mkdir(mode=0o700)
        # Held for the scratch's lifetime: the cleaner skips locked entries.
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield path
        finally:
            try:
                remove_tree(path)
            finally:
                os.close(fd)

    def scratch(self, purpose: str = "build") -> contextlib.AbstractContextManager[Path]:
        if not purpose.isidentifier():
            raise InvalidSpec(f"bad scratch purpose {purpose!r}", field="purpose")
        return self._scratch(purpose)

    def _clean_dead_scratch(self) -> None:
        """Remove tmp/ entries nobody holds (left by a crash).

        Live builds and imports hold an flock on their entry, which works across
        pid namespaces; the age check covers the instant between creating an
        entry and locking it.
        """
        now = time.time()
        for entry in self.tmp_dir.iterdir():
            try:
                if now - entry.lstat().st_mtime < _SCRATCH_GRACE_S:
                    continue
                fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # in use
            else:
                with contextlib.suppress(OSError, ImageError):
                    remove_tree(entry)
            finally:
                os.close(fd)

    def gc(self) -> builtins.list[Path]:
        """Delete blob files the index does not know (left by a crash); return them."""
        removed: builtins.list[Path] = []
        with self._write() as db:
            known = {r[0] for r in db.execute("SELECT digest FROM layers")}
            for blob in self.blob_dir.iterdir():
                if DIGEST_PREFIX + blob.name.removesuffix(".erofs") not in known:
                    blob.unlink()
                    removed.append(blob)
        self._clean_dead_scratch()
        return removed

    def disk_usage(self) -> int:
        """Bytes used by layer files."""
        return sum(p.stat().st_size for p in self.blob_dir.iterdir() if p.is_file())


def _host(url: str) -> str:
    return url.split("://", 1)[-1]


__all__ = ["LayerStore", "LocalLayerStore", "MountSource", "RemoteRecord", "RemoteSource"]
