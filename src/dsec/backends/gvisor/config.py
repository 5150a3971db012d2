"""The gVisor backend's part of an edge's configuration (``EdgeConfig.backends``).

Pure data: no I/O, nothing imported beyond pydantic. The backend itself
(:mod:`dsec.backends.gvisor.backend`) is imported only when an edge runs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from dsec.backends import BackendContext
    from dsec.backends.base import Backend



class GVisorConfig(BaseModel):
    """Sandboxes under gVisor's ``runsc`` (an application kernel in user space between the
    sandbox and the host kernel; docs/GVISOR.md)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["gvisor"] = "gvisor"
    runsc: Path | None = None
    """The runsc binary; None: ``runsc`` on PATH (Debian bookworm-backports' ``runsc`` package;
    scripts/setup.sh installs it)."""
    platform: Literal["systrap", "ptrace"] = "systrap"
    """How the sentry intercepts system calls. systrap (seccomp traps, ~2-3 us per call) needs a
    runsc from 2023 or later; ptrace (~50 us per call) works with any."""
    file_access: Literal["shared", "exclusive"] = "shared"
    """runsc's ``--file-access`` for the sandbox's root. ``shared``: the sentry revalidates what
    it caches, so host-side file operations (the files API) are seen at once and never
    corrupted; file system calls cost ~3-4x more (the bench loop: ~14-24 us per call against ~6 us,
    docs/GVISOR.md). ``exclusive``: faster, but the sentry assumes nobody else writes the
    files, so the backend then does not offer FILES (an edit from the host could be lost or
    overwritten by a stale cached size)."""
    pause_method: Literal["freezer", "runsc"] = "freezer"
    """``freezer``: freeze the sandbox's cgroup (the sentry, gofer and stubs stop at once: no CPU
    while paused; ~1 ms). ``runsc``: ``runsc pause``, which stops the sandbox's tasks inside the
    sentry (~150 ms; the sentry itself keeps a little CPU)."""
    uppers_image_size: Annotated[int, Field(ge=0)] = 0
    """Size of the btrfs image that holds writable layers on disk (``Resources.disk_medium="disk"``);
    0: 80 % of its disk's free space (sparse)."""
    uppers_path: Path | None = None
    """An existing btrfs mount for writable layers on disk, instead of the backend's own image."""
    host_pids_headroom: Annotated[int, Field(ge=64)] = 256
    """Host tasks allowed to a sandbox beyond ``Resources.pids`` (its pids cgroup): the sentry's
    and gofer's own threads. The sandbox's processes are limited inside gVisor (RLIMIT_NPROC);
    this is the host's backstop."""
    subreaper: bool = True
    """Make the process running the backend a child subreaper, so runsc's sandbox and gofer
    processes are reaped at once when they exit (else by the host's init, which can take
    seconds: ``runsc delete`` waits for it)."""
    debug_log_dir: Path | None = None
    """Write runsc's debug logs here (one file per command; for investigation only)."""

    def build(self, ctx: BackendContext) -> Backend:
        """The gVisor backend this config describes (not yet started)."""
        from dsec.backends.gvisor import build_backend  # the backend's own code, imported now

        return build_backend(self, ctx)
