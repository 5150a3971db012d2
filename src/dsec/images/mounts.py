"""The node-wide cache of mounted layers: each layer mounted once, read-only.

Each private mount of an EROFS image keeps its own page cache, so a node
mounts every layer exactly once, at ``<mount_root>/<hex digest>``, and all
sandboxes share it as an overlay lower. Mounts are file-backed EROFS (no loop
device) with ``MS_RDONLY|MS_NOSUID|MS_NODEV``. Who uses a layer is recorded
as a pin in the layer store, so pins survive a restart: a new
:class:`LayerMounts` calls :meth:`LayerMounts.adopt` to take over the mounts
the previous process left, and the edge's reconciler drops the pins of dead
sandboxes with :meth:`LayerStore.unpin_all_except`.

Owns mounts under ``mount_root`` only; never touches any other mount. Must
not assume a layer is a local file: it asks the store for a path
(:meth:`LayerStore.open_local`) and mounts whatever it gets.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from dsec.errors import ImageError, InvalidSpec, LayerNotFound

from . import sysmount
from .layer import DIGEST_PREFIX, check_digest, digest_hex
from .store import LayerStore

log = logging.getLogger("dsec.images")

MOUNT_FLAGS = sysmount.MS_RDONLY | sysmount.MS_NOSUID | sysmount.MS_NODEV
IDLE_PIN_GRACE_S = 1.0
"""How long a user of these mounts (the container runtime) keeps the pin of a layer after
its last sandbox stopped using it, so a create/destroy loop does not pay an index write per
sandbox. ``dsec image rm`` waits a little longer than this for such pins before it says
"in use"."""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class LayerMounts:
    """Mounts layers of ``store`` under ``mount_root`` on demand; thread-safe.

    ``mount_root`` must contain "dsec" in its path: host hygiene checks find
    DSec's mounts by that string.
    """

    def __init__(self, store: LayerStore, mount_root: Path, *, holders: Iterable[str] = ()) -> None:
        """``holders``: the pins that keep these mounts in use (a backend's own holder name).
        Another backend's pin on the same layer keeps that backend's mount, not these: with
        none given, any pin keeps a mount (and every holder that acquires through this
        instance is one of its own from then on)."""
        self.store = store
        self._holders: set[str] = set(holders)
        self.mount_root = Path(mount_root).absolute()
        if "dsec" not in str(self.mount_root):
            raise InvalidSpec(
                f"layer mount root {self.mount_root} must contain 'dsec' in its path "
                "(leak checks find DSec mounts by it); e.g. /run/dsec/layers",
                field="mount_root",
            )
        self.mount_root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._mounted: dict[str, Path] = {}
        # A file object (not a bare fd) so an instance dropped without close() frees it.
        self._lock_file: BinaryIO | None = open(self.mount_root / ".lock", "ab")  # noqa: SIM115

    def __repr__(self) -> str:
        return f"LayerMounts({self.store!r}, {str(self.mount_root)!r})"

    def __enter__(self) -> LayerMounts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def mountpoint(self, digest: str) -> Path:
        return self.mount_root / digest_hex(digest)

    def mounted(self) -> dict[str, Path]:
        """Digest -> mountpoint of every layer this instance has mounted or adopted."""
        with self._lock:
            return dict(self._mounted)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Serialise against threads (RLock) and other processes (flock on .lock)."""
        with self._lock:
            if self._lock_file is None:
                raise ImageError(
                    "this LayerMounts is closed; create a new one", path=str(self.mount_root)
                )
            fd = self._lock_file.fileno()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    # -- acquire / release ---------------------------------------------------

    def acquire(self, digest: str, holder: str) -> Path:
        """Pin ``digest`` for ``holder`` and return its (shared, read-only) mountpoint."""
        check_digest(digest)
        with self._exclusive():
            self._holders.add(holder)
            new_pin = self.store.pin(digest, holder)
            try:
                mp = self._mounted.get(digest)
                if mp is None:
                    mp = self._mount(digest)
                    self._mounted[digest] = mp
                return mp
            except BaseException:
                if new_pin:
                    self.store.unpin(digest, holder)
                raise

    def release(self, digest: str, holder: str) -> None:
        """Drop ``holder``'s pin. The layer stays mounted (a cache for the next acquire) until
        :meth:`unmount_unused`, or :meth:`unmount_if_removed` once the store drops it."""
        check_digest(digest)
        with self._lock:
            self.store.unpin(digest, holder)

    def _mount(self, digest: str) -> Path:
        mp = self.mountpoint(digest)
        mp.mkdir(mode=0o755, exist_ok=True)
        if self._mounts_at(mp):
            return mp  # mounted by an earlier process; take it over
        found = self.store.mount_source(digest)
        source = found.path
        try:
            sysmount.mount(os.fspath(source), os.fspath(mp), "erofs", MOUNT_FLAGS, found.options)
        except OSError as e:
            with contextlib.suppress(OSError):
                mp.rmdir()
            hint = {
                errno.EPERM: "mounting needs CAP_SYS_ADMIN (run the edge as root)",
                errno.ENODEV: "the kernel lacks EROFS (modprobe erofs)",
                errno.ENOTBLK: "the kernel lacks file-backed EROFS (needs Linux >= 6.12)",
                errno.EINVAL: "the file is not a valid EROFS image or the kernel rejected it",
            }.get(e.errno or 0, "see the kernel log (dmesg)")
            raise ImageError(
                f"cannot mount layer {digest} from {source} at {mp}: {e.strerror}; {hint}",
                digest=digest,
                errno=e.errno,
            ) from e
        log.debug("mounted layer %s at %s", digest, mp)
        return mp

    # -- unmounting ----------------------------------------------------------

    def _mounts_at(self, mp: Path) -> int:
        target = os.fspath(mp)
        return sum(1 for m in sysmount.mountinfo() if m.mount_point == target)

    def _unmount(self, mp: Path) -> bool:
        """Unmount everything stacked at ``mp`` and remove the directory; False if busy."""
        for _ in range(self._mounts_at(mp)):
            try:
                sysmount.umount(os.fspath(mp))
            except OSError as e:
                if e.errno == errno.EINVAL:
                    break  # not mounted any more
                if e.errno == errno.EBUSY:
                    log.warning("layer mount %s is busy; leaving it mounted", mp)
                    return False
                raise ImageError(f"cannot unmount {mp}: {e.strerror}", path=str(mp)) from e
        with contextlib.suppress(FileNotFoundError):
            mp.rmdir()
        return True

    def unmount_unused(self) -> list[str]:
        """Unmount layers nobody pins; return their digests."""
        done: list[str] = []
        with self._exclusive():
            for digest, mp in list(self._mounted.items()):
                pins = self.store.holders(digest)
                if pins & self._holders if self._holders else pins:
                    continue  # in use through this instance (a pin of another backend keeps its own mount)
                if self._unmount(mp):
                    del self._mounted[digest]
                    done.append(digest)
                    self._release(digest)
        return done

    def unmount_if_removed(self, digest: str) -> bool:
        """Unmount ``digest`` if the store no longer has it (removed while nobody pinned it,
        e.g. by ``dsec image rm`` in another process), which frees its file's disk. True when
        it is not mounted here any more; False while the store still has it (one index read)
        or the mount is busy."""
        check_digest(digest)
        with self._lock:
            if self._lock_file is None or digest not in self._mounted:
                return True
        if self._known(digest):
            return False
        with self._exclusive():
            mp = self._mounted.get(digest)
            if mp is None:
                return True
            if self._known(digest):  # stored again meanwhile: the mount serves it as it is
                return False
            if not self._unmount(mp):
                return False
            del self._mounted[digest]
            self._release(digest)
        log.debug("unmounted layer %s: removed from %r", digest, self.store)
        return True

    def _release(self, digest: str) -> None:
        """Tell the store the layer's file is not mounted here any more (a lazily loaded
        layer's file can then be detached); a failure there is logged, not raised."""
        try:
            self.store.release_local(digest)
        except Exception as exc:  # the unmount itself succeeded
            log.warning("layer %s unmounted, but the store could not release its file: %r", digest, exc)

    def _known(self, digest: str) -> bool:
        try:
            self.store.get(digest)
        except LayerNotFound:
            return False
        return True

    def adopt(self) -> list[str]:
        """Take over EROFS mounts a previous process left under ``mount_root``.

        Mounts of layers the store no longer knows are unmounted, as are extra
        mounts stacked on one mountpoint; empty stale mountpoint directories are
        removed. Returns the digests now tracked.
        """
        with self._exclusive():
            seen: set[str] = set()
            for m in sysmount.mountinfo():
                mp = Path(m.mount_point)
                if mp.parent != self.mount_root or not _HEX64.match(mp.name) or mp.name in seen:
                    continue
                seen.add(mp.name)
                digest = DIGEST_PREFIX + mp.name
                known = m.fstype == "erofs"
                if known:
                    try:
                        self.store.get(digest)
                    except LayerNotFound:
                        known = False
                if not known:
                    log.warning("unmounting %s: not a layer of %r", mp, self.store)
                    self._unmount(mp)
                    continue
                stacked = self._mounts_at(mp)
                for _ in range(stacked - 1):
                    sysmount.umount(os.fspath(mp))
                self._mounted[digest] = mp
            for entry in self.mount_root.iterdir():
                if _HEX64.match(entry.name) and entry.name not in seen and entry.is_dir():
                    with contextlib.suppress(OSError):
                        entry.rmdir()
            return sorted(self._mounted)

    # -- healing ---------------------------------------------------------------

    def remount(self, digest: str) -> tuple[Path, bool]:
        """Mount ``digest`` again where it belongs (someone unmounted it): its mountpoint, and
        whether a mount was made (False: it was mounted). Sandboxes running on the layer are
        unaffected either way (theirs is a clone of the mount)."""
        check_digest(digest)
        with self._exclusive():
            self.mount_root.mkdir(parents=True, exist_ok=True)
            made = not self._mounts_at(self.mountpoint(digest))
            mp = self._mount(digest)
            self._mounted[digest] = mp
            return mp, made

    def check(self, *, repair: bool) -> tuple[list[str], list[str]]:
        """(problems left, repairs made): every layer this instance mounted must still be
        mounted at its mountpoint; with ``repair``, one that is not is mounted again."""
        problems: list[str] = []
        repaired: list[str] = []
        with self._exclusive():
            present = {m.mount_point for m in sysmount.mountinfo()}
            for digest, mp in list(self._mounted.items()):
                if os.fspath(mp) in present:
                    continue
                if not repair:
                    problems.append(f"layer {digest} is not mounted at {mp}")
                    continue
                try:
                    self.mount_root.mkdir(parents=True, exist_ok=True)
                    self._mount(digest)
                    repaired.append(f"re-mounted layer {digest} at {mp} (it had been unmounted)")
                except (ImageError, OSError) as exc:
                    problems.append(f"layer {digest} is not mounted at {mp} and cannot be mounted again: {exc}")
        return problems, repaired

    def close(self) -> None:
        """Unmount every unused layer; pinned ones stay mounted for the next adopt()."""
        with self._lock:
            if self._lock_file is None:
                return
            try:
                self.unmount_unused()
            finally:
                self._lock_file.close()
                self._lock_file = None


__all__ = ["IDLE_PIN_GRACE_S", "MOUNT_FLAGS", "LayerMounts"]
