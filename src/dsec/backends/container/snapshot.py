"""pack_diff: a sandbox's writable layer packed into an immutable snapshot layer.

How a snapshot is made (docs/SNAPSHOTS.md, "Snapshots"):

1. **Plan.** The new layer's lineage is the sandbox's layers (top first). If
   the stack would grow past ``max_layers``, the run of snapshot layers at the
   top of the sandbox's stack is merged into the new layer (collapse), so the
   overlay never sees more lowers than the spawner passes (15).
2. **Check space** in the layer store: the copy and the image need about
   twice the writable layer (plus what is merged); too little raises
   :class:`StorageFull` before anything is frozen.
3. **Copy out, frozen.** Layers being merged are copied first (they are
   immutable, no freeze needed). The upper is read through the init's fd 3
   (``/proc/<init>/fd/3/upper``). A running sandbox's upper is first copied
   while it runs; then it is frozen, the copy is brought up to date (only
   entries whose inode or ctime changed since are copied again, deleted ones
   removed) and it is thawed. A paused sandbox (already frozen), or one whose
   snapshot collapses a chain, is copied in one pass. Writes made during the
   frozen pass wait for it, so they never tear the snapshot. The tree goes to a tmpfs when the
   host has one and RAM to spare (memory speed), else beside the image.
4. **Compress** the tree with mkfs.erofs (lz4, mtimes kept) outside the
   freeze and register it as kind ``snapshot`` with the lineage as parents.

Whatever fails, the scratch directory goes, the sandbox is thawed (unless it
was paused), and no layer is registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from dsec.backends.container import pause as pausing
from dsec.backends.container import wire
from dsec.errors import InvalidSpec, SandboxFailed, SandboxStateError
from dsec.images.diff import DiffStats, Excluder, apply_diff, open_dir, resync_diff, tree_bytes
from dsec.images.erofs import make_erofs
from dsec.images.errors import LayerBuildError, StorageFull
from dsec.images.layer import Layer, LayerKind, check_name, check_tag
from dsec.spec import SandboxState

if TYPE_CHECKING:
    from dsec.backends.common.records import RecordBook
    from dsec.backends.common.uppers import UpperUsage
    from dsec.backends.container.cgroups import RuntimeCgroups
    from dsec.backends.container.layerbook import NodeLayers
    from dsec.backends.container.records import ContainerRecord
    from dsec.backends.container.sandbox import ContainerSandbox


class SnapshotNode(Protocol):
    """What a snapshot uses of its node (the container runtime satisfies it)."""

    name: str
    run_dir: Path
    cgroups: RuntimeCgroups
    reclaim_method: pausing.ReclaimMethod
    max_layers: int
    snapshot_compressor: str
    snapshot_precopy: bool
    snapshot_scratch: str

    @property
    def store(self) -> Any: ...
    @property
    def sandboxes(self) -> Mapping[str, ContainerRecord]: ...
    def get(self, sandbox_id: str) -> ContainerRecord: ...
    def live(self, sandbox_id: str) -> ContainerSandbox: ...
    def init_handle(self, rec: ContainerRecord) -> int: ...
    @property
    def layers(self) -> NodeLayers: ...
    @property
    def records(self) -> RecordBook[ContainerRecord]: ...
    def disk_usage(self, sandbox_id: str) -> UpperUsage: ...

MAX_LOWERS: Final = wire.MAX_LAYERS
"""Layers a sandbox can stack (the spawner's cap)."""
"""Lower layers the spawner mounts at most (it reads 15 ``lower`` fields)."""
DEFAULT_MAX_LAYERS: Final = 8
"""Collapse when a snapshot's stack would exceed this (room left for toolkits on top)."""
SNAPSHOT_COMPRESSOR: Final = "lz4"
"""lz4 over lz4hc: 256 MB of mixed files took 2-3 s with lz4 and 75-80 s with lz4hc here
(172 vs 141 MiB); "none" took ~1 s (244 MiB)."""
PRECOPY_TICK_NS: Final = 50_000_000
"""Entries whose ctime is this close to the first pass's start are copied again under the freeze:
inode times come from a coarse clock (a jiffy), so a change right after the first pass read an
entry can carry the same ctime it had then."""
RAM_RESERVE: Final = 1 << 30
"""The copy goes to RAM only if twice its size plus this stays available."""
FORK_NAME: Final = "dsec-fork"
"""Name of the unnamed snapshots made by fork: removed once no sandbox uses them."""
SPACE_MARGIN: Final = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SnapshotPlan:
    merge: tuple[str, ...]
    """Lower layers merged into the new one (top first): the collapsed run."""
    parents: tuple[str, ...]
    """The new layer's lineage (top first)."""


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    layer: Layer
    stats: DiffStats
    frozen_s: float
    """Seconds the sandbox was frozen for the copy (0 if it was paused already)."""
    seconds: float
    collapsed: tuple[str, ...]


def plan(layers: Sequence[str], kind_of: Any, max_layers: int = DEFAULT_MAX_LAYERS) -> SnapshotPlan:
    """Lineage and collapse for a snapshot over ``layers`` (top first).

    ``kind_of(digest) -> LayerKind``. The whole run of snapshot layers at the top
    is merged when the stack would exceed ``max_layers`` (merging all of it, not
    just enough, keeps later snapshots from paying for a merge each time)."""
    if not 2 <= max_layers <= MAX_LOWERS:
        raise InvalidSpec(f"max_layers must be within 2..{MAX_LOWERS}", field="max_layers")
    if len(layers) + 1 <= max_layers:
        return SnapshotPlan((), tuple(layers))
    run = 0
    while run < len(layers) and kind_of(layers[run]) is LayerKind.SNAPSHOT:
        run += 1
    if len(layers) - run + 1 > max_layers:
        raise InvalidSpec(
            f"this sandbox stacks {len(layers)} layers and only {run} on top are snapshots: a snapshot "
            f"would exceed {max_layers} layers even after collapsing them (fewer toolkits, or a larger max_layers)",
            field="max_layers",
        )
    return SnapshotPlan(tuple(layers[:run]), tuple(layers[run:]))


def default_name(sandbox_id: str) -> str:
    return check_name(f"snap-{sandbox_id}"[:128])


def default_tag() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _storage_full(exc: OSError, stage: str, where: Path, sandbox_id: str) -> StorageFull:
    return StorageFull(
        f"no space left in the layer store ({where}) while packing a snapshot of {sandbox_id} "
        f"(stage {stage}); free disk or leave large paths out with exclude=[...]",
        stage=stage, path=str(where), sandbox_id=sandbox_id, errno=exc.errno,
    )


def _tmpfs_of(path: Path) -> bool:
    """Is ``path`` (or its nearest existing ancestor) on a tmpfs? Read from /proc/self/mountinfo."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    target = os.path.realpath(probe)
    best, fstype = "", ""
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            mp = parts[4]
            if (target == mp or target.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
                best, fstype = mp, parts[parts.index("-") + 1]
    return fstype == "tmpfs"


def ram_scratch_root(rt: SnapshotNode) -> Path | None:
    """Where the upper is copied while the sandbox is frozen: a tmpfs (memory speed, ~0.2-0.3 s per
    100 MB here, against 1-4 s into this machine's disk), or None if the host offers none."""
    if rt.snapshot_scratch == "store":
        return None
    for root in (rt.run_dir / "snapshot-tmp", Path("/dev/shm") / f"dsec-{rt.name}-snapshot-tmp"):
        if _tmpfs_of(root):
            return root
    return None


def clean_scratch(rt: SnapshotNode) -> None:
    """Remove copies left by a crash (only this runtime copies into its scratch roots)."""
    root = ram_scratch_root(rt)
    if root is not None and root.is_dir():
        shutil.rmtree(root, ignore_errors=True)


def _available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def _tree_dir(rt: SnapshotNode, store_scratch: Path, need: int) -> Iterator[Path]:
    """The scratch tree: in RAM when there is a tmpfs and room for it, else beside the image."""
    root = ram_scratch_root(rt)
    if root is not None and _available_ram() > 2 * need + RAM_RESERVE:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        tree = root / f"{os.getpid()}-{secrets.token_hex(6)}"
        tree.mkdir(mode=0o755)
        try:
            yield tree
        finally:
            shutil.rmtree(tree, ignore_errors=True)
        return
    tree = store_scratch / "tree"
    tree.mkdir(mode=0o755)
    yield tree  # removed with the store's scratch


async def make_snapshot(
    rt: SnapshotNode,
    sandbox_id: str,
    *,
    name: str | None = None,
    tag: str | None = None,
    exclude: Iterable[str] = (),
    max_layers: int | None = None,
    ephemeral: bool = False,
) -> SnapshotInfo:
    rec = rt.get(sandbox_id)
    if rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
        raise SandboxStateError(
            f"sandbox {sandbox_id} is {rec.state.value}: only a running or paused sandbox can be snapshotted"
            + (f" ({rec.reason})" if rec.reason else ""),
            sandbox_id=sandbox_id, state=rec.state.value,
        )
    # A name given means "that name": tag latest, like an image build. No name: a unique tag.
    tag = check_tag(tag) if tag is not None else ("latest" if name is not None else default_tag())
    name = check_name(name) if name is not None else default_name(sandbox_id)
    try:
        excluder = Excluder(exclude)
    except ValueError as exc:
        raise InvalidSpec(str(exc), field="exclude") from None
    store = rt.store
    the_plan = plan(rec.layers, lambda d: store.get(d).kind, max_layers or rt.max_layers)
    t0 = time.perf_counter()
    box = rt.live(sandbox_id)
    stats = DiffStats()
    frozen_s = 0.0
    with store.scratch("snapshot") as scratch, contextlib.ExitStack() as stack:
        async with box.lock:
            rec = rt.get(sandbox_id)
            if rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                raise SandboxStateError(f"sandbox {sandbox_id} is {rec.state.value}", sandbox_id=sandbox_id,
                                        state=rec.state.value)
            pidfd = rt.init_handle(rec)  # SandboxFailed if the init is gone
            try:
                upper = Path(f"/proc/{rec.init_pid}/fd/3")
                try:
                    used = rt.disk_usage(sandbox_id).used
                    upper_fd = open_dir(upper / "upper")
                except OSError:
                    rt.records.mark_failed(rec, "the sandbox's init process is gone")
                    raise SandboxFailed(f"sandbox {sandbox_id} has failed: its init process is gone",
                                        sandbox_id=sandbox_id, reason="init_exited") from None
            finally:
                os.close(pidfd)
            tree: Path | None = None
            try:
                if excluder and used:
                    used = await asyncio.to_thread(tree_bytes, upper_fd, excluder)
                merged = sum(store.get(d).size * 6 for d in the_plan.merge)
                tree = stack.enter_context(_tree_dir(rt, scratch, used + merged))
                in_ram = not tree.is_relative_to(scratch)
                # The store needs the image (at most about the tree's size); with the tree on
                # disk too, twice that.
                need = (used + merged) * (1 if in_ram else 2) + SPACE_MARGIN
                if _free(scratch) < need:
                    raise StorageFull(
                        f"the layer store ({scratch.parent}) has {_free(scratch) >> 20} MiB free; packing a "
                        f"snapshot of {sandbox_id} needs about {need >> 20} MiB (free disk or exclude large paths)",
                        stage="check", path=str(scratch.parent), sandbox_id=sandbox_id,
                    )
                # Lower layers of the collapsed run: immutable, copied before the freeze.
                for digest in reversed(the_plan.merge):
                    src = open_dir(rt.layers.path(digest))
                    try:
                        await asyncio.to_thread(apply_diff, src, tree, stats=stats, root_meta=False)
                    finally:
                        os.close(src)
                was_paused = rec.state is SandboxState.PAUSED
                # Two passes when nothing is merged and the sandbox runs: copy everything while it
                # runs, then freeze and copy again only what changed meanwhile (ctime says so).
                seen: dict[str, tuple[int, int]] | None = None
                since_ns = 0
                if not was_paused and not the_plan.merge and rt.snapshot_precopy:
                    seen = {}
                    since_ns = time.clock_gettime_ns(time.CLOCK_REALTIME) - PRECOPY_TICK_NS
                    await asyncio.to_thread(apply_diff, upper_fd, tree, uid_shift=rec.uid_base, exclude=excluder,
                                            stats=stats, record=seen)
                box.begin_pack()
                try:
                    if not was_paused:
                        frozen_s = await pausing.freeze(rt.cgroups, sandbox_id)
                    tf = time.perf_counter()
                    if seen is not None:
                        await asyncio.to_thread(resync_diff, upper_fd, tree, seen, since_ns, uid_shift=rec.uid_base,
                                                exclude=excluder, stats=stats)
                    else:
                        await asyncio.to_thread(apply_diff, upper_fd, tree, uid_shift=rec.uid_base,
                                                exclude=excluder, stats=stats)
                    frozen_s = 0.0 if was_paused else frozen_s + time.perf_counter() - tf
                finally:
                    woken = box.end_pack()
                    if not was_paused or woken:
                        with contextlib.suppress(OSError):
                            pausing.thaw(rt.cgroups, sandbox_id)
                    elif rec.state is SandboxState.PAUSED:
                        # Reading the upper paged it back in: push it out again.
                        with contextlib.suppress(OSError):
                            await asyncio.to_thread(pausing.reclaim, rt.cgroups, sandbox_id, rt.reclaim_method)
            except StorageFull:
                raise
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    where = tree.parent if tree is not None and not tree.is_relative_to(scratch) else scratch.parent
                    raise _storage_full(exc, "copy", where, sandbox_id) from None
                raise LayerBuildError(f"cannot copy the writable layer of {sandbox_id}: {exc}", stage="copy",
                                      sandbox_id=sandbox_id) from exc
            except RecursionError:
                raise LayerBuildError(f"the writable layer of {sandbox_id} nests directories too deeply to pack",
                                      stage="copy", sandbox_id=sandbox_id) from None
            finally:
                os.close(upper_fd)
        assert tree is not None
        image = scratch / "layer.erofs"
        try:
            await asyncio.to_thread(make_erofs, tree, image, compressor=rt.snapshot_compressor, keep_mtimes=True)
            layer: Layer = await asyncio.to_thread(
                store.add_erofs, image, name=name, tag=tag, kind=LayerKind.SNAPSHOT, parents=the_plan.parents,
                consume=True,
            )
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _storage_full(exc, "store", scratch.parent, sandbox_id) from None
            raise
    if ephemeral:
        rt.layers.mark_ephemeral(layer.digest)
    elapsed = time.perf_counter() - t0
    rec2 = rt.sandboxes.get(sandbox_id)
    if rec2 is not None:
        rt.records.event(rec2, "snapshot", digest=layer.digest, ref=layer.ref, size=layer.size, bytes=stats.bytes,
                 frozen_s=round(frozen_s, 6), seconds=round(elapsed, 6), collapsed=len(the_plan.merge))
    return SnapshotInfo(layer, stats, frozen_s, elapsed, the_plan.merge)


def fresh_identity(files: Any) -> None:
    """A forked child's own identity: a new /etc/machine-id, no inherited random seed.

    (Its hostname is its id already: every sandbox gets one at create.)"""
    if files.exists("/etc"):
        files.write("/etc/machine-id", (secrets.token_hex(16) + "\n").encode(), mode=0o444)
    for seed in ("/var/lib/systemd/random-seed", "/var/lib/urandom/random-seed"):
        with contextlib.suppress(Exception):
            if files.exists(seed):
                files.remove(seed)


__all__ = [
    "DEFAULT_MAX_LAYERS",
    "FORK_NAME",
    "MAX_LOWERS",
    "SnapshotInfo",
    "SnapshotPlan",
    "default_tag",
    "fresh_identity",
    "make_snapshot",
    "plan",
]
