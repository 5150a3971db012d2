"""The edge's handle on the node's lazy layer process: :class:`LazyLayers`.

Starts (or adopts) the one FUSE process of the node, attaches and detaches layers
through its control socket, and cleans up after a crash with :meth:`LazyLayers.reconcile`.
The edge's storage code uses it like this::

    lazy = LazyLayers(Path("/run/dsec/lazy"), Path("/var/lib/dsec/chunks"), cache_limit_bytes=50 << 30)
    lazy.start()                          # reconciles, then starts or adopts the process
    path = lazy.attach(RemoteLayer(...))  # /run/dsec/lazy/<hex>.erofs, metadata fetched
    ...mount EROFS from `path` exactly as from a local file (LayerMounts)...
    lazy.detach(digest)                   # after the EROFS mount is gone
    lazy.close()

Blocking calls (a unix socket round trip; attach waits for the metadata chunks):
async callers run them in a worker thread. Owns the process it started, the FUSE
mount at ``mountpoint`` and ``.tmp-*`` files in the cache; never unmounts anything
else (EROFS mounts made from its files belong to the runtime: reconcile reports them).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.images import sysmount

from . import control
from .cache import remove_partials
from .errors import ServiceDown
from .model import FSNAME, RemoteLayer

log = logging.getLogger("dsec.images.lazy")

PID_FILE = "lazy-serve.pid"


@dataclass
class ReconcileReport:
    alive: bool = False
    """A live process answered on the control socket: nothing was cleaned."""
    unmounted: bool = False
    """A dead FUSE mount at the mountpoint was lazily unmounted."""
    killed_pid: int | None = None
    """A process of ours that held the mountpoint but did not answer was killed."""
    partial_files: int = 0
    stale_mounts: list[str] = field(default_factory=list)
    """Mount points of EROFS mounts made from files of the dead mount (the runtime's to
    unmount; their reads fail)."""


class LazyLayers:
    def __init__(
        self,
        mountpoint: Path,
        cache_dir: Path,
        *,
        socket_path: Path | None = None,
        state_path: Path | None = None,
        cache_limit_bytes: int | None = None,
        read_deadline_s: float = 30.0,
        fetch_attempts: int = 4,
        attempt_timeout_s: float = 10.0,
        backoff_s: float = 0.1,
        max_fetches: int = 16,
        readahead_chunks: int = 4,
        log_path: Path | None = None,
        start_timeout_s: float = 15.0,
        call_timeout_s: float = 120.0,
        python: str = sys.executable,
    ) -> None:
        self.mountpoint = Path(mountpoint).absolute()
        self.cache_dir = Path(cache_dir).absolute()
        self.socket_path = socket_path or self.cache_dir / "lazy.sock"
        self.state_path = state_path or self.cache_dir / "lazy-state.json"
        self.log_path = log_path or self.cache_dir / "lazy.log"
        self.cache_limit_bytes = cache_limit_bytes
        self.read_deadline_s = read_deadline_s
        self.fetch_attempts = fetch_attempts
        self.attempt_timeout_s = attempt_timeout_s
        self.backoff_s = backoff_s
        self.max_fetches = max_fetches
        self.readahead_chunks = readahead_chunks
        self.start_timeout_s = start_timeout_s
        self.call_timeout_s = call_timeout_s
        self.python = python
        self._proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None

    def __repr__(self) -> str:
        return f"LazyLayers({str(self.mountpoint)!r}, {str(self.cache_dir)!r}, pid={self.pid})"

    def __enter__(self) -> LazyLayers:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- lifetime --

    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", "dsec.images.lazy.serve",
            "--root", str(self.mountpoint), "--cache", str(self.cache_dir),
            "--socket", str(self.socket_path), "--state", str(self.state_path),
            "--read-deadline", str(self.read_deadline_s),
            "--fetch-attempts", str(self.fetch_attempts),
            "--attempt-timeout", str(self.attempt_timeout_s),
            "--backoff", str(self.backoff_s),
            "--max-fetches", str(self.max_fetches),
            "--readahead", str(self.readahead_chunks),
        ]
        if self.cache_limit_bytes:
            cmd += ["--cache-limit", str(self.cache_limit_bytes)]
        return cmd

    def start(self) -> None:
        """Adopt the node's running process, or reconcile and start one; idempotent.
        Layers listed in the state file are attached again by the new process."""
        if self.pid is not None and self._ping() is not None:
            return
        ping = self._ping()
        if ping is not None:
            self.pid = int(ping["pid"])
            log.info("adopted lazy layer process %d at %s", self.pid, self.mountpoint)
            return
        self.reconcile()
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            # Its own session: the node's FUSE process outlives an edge restart.
            self._proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=logf,
                start_new_session=True, close_fds=True,
            )
        finally:
            logf.close()
        (self.cache_dir / PID_FILE).write_text(str(self._proc.pid))
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServiceDown(
                    f"the lazy layer process exited ({self._proc.returncode}) at start; see {self.log_path}: "
                    + self._log_tail(), socket=str(self.socket_path),
                )
            ping = self._ping()
            if ping is not None:
                self.pid = int(ping["pid"])
                return
            time.sleep(0.02)
        self._stop_proc(self._proc.pid)
        raise ServiceDown(f"the lazy layer process did not answer within {self.start_timeout_s} s; "
                          f"see {self.log_path}: " + self._log_tail(), socket=str(self.socket_path))

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-1500:]
        return ""

    def close(self, *, timeout_s: float = 10.0) -> None:
        """SIGTERM the process (it unmounts) and wait; SIGKILL and reconcile if it lingers.
        Unmount the EROFS mounts of its layers first: their reads fail afterwards."""
        pid = self.pid
        if pid is None:
            with contextlib.suppress(OSError, ValueError):
                pid = int((self.cache_dir / PID_FILE).read_text())
            if pid is None or not _is_serve(pid):
                return
        self._stop_proc(pid, timeout_s=timeout_s)
        self.pid = None
        self._proc = None
        with contextlib.suppress(FileNotFoundError):
            (self.cache_dir / PID_FILE).unlink()
        self.reconcile()
        if not any(m.mount_point == str(self.mountpoint) for m in sysmount.mountinfo()):
            with contextlib.suppress(OSError):  # the empty mountpoint goes with the process
                self.mountpoint.rmdir()

    def _stop_proc(self, pid: int, *, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not self._wait_exit(pid, timeout_s):
            log.warning("lazy layer process %d ignored SIGTERM; killing it", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._wait_exit(pid, 5.0)

    def _wait_exit(self, pid: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.pid == pid:
                if self._proc.poll() is not None:
                    return True
            elif not _alive(pid):
                return True
            time.sleep(0.02)
        return False

    # --------------------------------------------------------------- layers --

    def attach(self, ref: RemoteLayer, *, prefetch_metadata: bool = True, prefetch_all: bool = False,
               extents_of: str = "") -> Path:
        """Expose ``ref`` as ``<mountpoint>/<hex>.erofs`` and return that path: the file to
        mount EROFS from. With ``prefetch_metadata`` (default) returns once the chunks
        holding the image's metadata are cached. Raises LayerUnavailable (registry
        unreachable, nothing cached) or ChunkCorrupt; idempotent (refreshes headers).
        ``prefetch_all`` fetches every chunk first (a lazy form's small metadata image);
        ``prefetch_metadata=False`` none (a lazy form's data device; ``extents_of`` names its
        attached metadata image, whose file extents then size the fetches of a miss)."""
        answer = self._call({"op": "attach", "layer": ref.model_dump(mode="json"),
                             "prefetch_metadata": prefetch_metadata, "prefetch_all": prefetch_all,
                             "extents_of": extents_of})
        return Path(answer["path"])

    def detach(self, digest: str) -> bool:
        """Remove the layer's file; raises LayerBusy while an EROFS mount holds it open."""
        return bool(self._call({"op": "detach", "digest": digest})["detached"])

    def path(self, digest: str) -> Path:
        return self.mountpoint / f"{digest.removeprefix('sha256:')}.erofs"

    def stats(self) -> dict[str, Any]:
        """Counters of the process (see docs/IMAGES.md, "Lazy layers")."""
        stats: dict[str, Any] = self._call({"op": "stats"})["stats"]
        return stats

    def fully_cached(self, digest: str) -> bool:
        layer = self.stats()["layers"].get(digest.removeprefix("sha256:"))
        return bool(layer and layer["fully_cached"])

    def materialize(self, digest: str, dest: Path) -> Path:
        """Write the whole layer to the local file ``dest`` (fetching what is not cached),
        verified against its digest. The runtime's switch for a hot layer: import
        ``dest`` into the local layer store and mount it from there, bypassing FUSE."""
        answer = self._call({"op": "materialize", "digest": digest, "dest": str(Path(dest).absolute())})
        return Path(answer["path"])

    def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        return control.call(self.socket_path, req, timeout_s=self.call_timeout_s)

    def _ping(self) -> dict[str, Any] | None:
        try:
            return control.call(self.socket_path, {"op": "ping"}, timeout_s=2.0)
        except ServiceDown:
            return None

    # ------------------------------------------------------------- reconcile --

    def reconcile(self) -> ReconcileReport:
        """Clean up after a dead process: lazily unmount a FUSE mount nobody serves, kill a
        hung process of ours, remove partial cache files. Does nothing while a live process
        answers. Safe to call any time; the EROFS mounts made from the dead mount's files
        are reported in ``stale_mounts`` for their owner to unmount."""
        report = ReconcileReport()
        if self._ping() is not None:
            report.alive = True
            return report
        with contextlib.suppress(OSError, ValueError):
            pid = int((self.cache_dir / PID_FILE).read_text())
            if _is_serve(pid):
                os.kill(pid, signal.SIGKILL)
                report.killed_pid = pid
                self._wait_exit(pid, 5.0)
        mp = str(self.mountpoint)
        mounts = sysmount.mountinfo()
        for m in mounts:
            if m.mount_point == mp and m.fstype.startswith("fuse"):
                try:
                    sysmount.umount(mp, sysmount.MNT_DETACH)
                    report.unmounted = True
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOENT):
                        raise
        report.stale_mounts = [
            m.mount_point for m in mounts if m.fstype == "erofs" and m.source.startswith(mp + "/")
        ]
        report.partial_files = remove_partials(self.cache_dir)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        with contextlib.suppress(FileNotFoundError):
            (self.cache_dir / PID_FILE).unlink()
        self.pid = None
        if report.unmounted or report.killed_pid or report.partial_files or report.stale_mounts:
            log.warning("lazy layers reconciled: %s", report)
        return report


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rindex(b")") + 2 :].split()[0] not in (b"Z", b"X")


def _is_serve(pid: int) -> bool:
    """A live process running this package's serve module (not a recycled pid)."""
    if not _alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"dsec.images.lazy.serve" in f.read()
    except OSError:
        return False


__all__ = ["FSNAME", "LazyLayers", "ReconcileReport"]
