"""A lazy form's prefetch profile: which chunks of the data device a start-up command reads.

A sandbox's first exec from a lazily loaded layer faults its files in one after
another (the dynamic loader, then libc, then the interpreter, then its modules...),
and each miss is a registry round trip: thirty to fifty of them in a row for a
Python start-up. Recorded once at push time, the chunks that start-up reads let an
edge fetch them all at once, in parallel, when it attaches the layer
(docs/IMAGES.md, "Prefetch profile"), as eStargz's and nydus's prefetch lists do.

How it is recorded (``dsec image push --profile CMD``), right after the lazy form's
blobs are uploaded: a private lazy loader (:class:`~dsec.images.lazy.LazyLayers`, with
an empty chunk cache of its own) attaches the lazy form from the registry exactly as
an edge does; the layer is mounted from it (file-backed EROFS, ``device=`` the data
file; the layer's local parents below it, an overlayfs with a throwaway upper on
top) in new mount, pid, network, IPC and UTS namespaces; ``CMD`` runs there as
``/bin/sh -c CMD``, chrooted, with no network and only
``/dev/{null,zero,full,random,urandom}``; the profile is the set of data chunks the
loader fetched meanwhile: what an edge's loader would fetch on demand for the same
start-up (its file-sized fetches and readahead included), independent of the host's
page cache and readahead settings. Every mount of the run lives in the private
mount namespace and goes with it when the command's pid namespace ends; the loader
is closed and its scratch removed: nothing is left on the host.

The child side (:func:`main`) runs as ``python -m dsec.images.lazyprofile`` under
``unshare``; it is not an API.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dsec.errors import ImageError

if TYPE_CHECKING:
    from .registry import LazyForm, RegistryClient

DEFAULT_TIMEOUT_S = 300.0
"""A profile command that runs longer is killed (with everything it started)."""
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_DEVICES = ("null", "zero", "full", "random", "urandom")
_SETUP_FAILED = 213
"""The child's exit status when it could not mount or chroot (told apart from the command's)."""
_MS_BIND = 0x1000


class ProfileUnavailable(ImageError):
    """A prefetch profile cannot be recorded here (``reason``); the push goes on without one."""


@dataclass(frozen=True)
class ProfileRun:
    """What a profile run did: the command, its exit status, how long it took, the tail
    of its output, and the data device's chunks the loader fetched."""

    command: str
    returncode: int
    seconds: float
    output_tail: str
    chunks: tuple[int, ...]
    """Indexes into the data device's chunk table, sorted."""
    bytes_fetched: int
    """Bytes of those chunks as stored in the registry (compressed)."""


def record_profile(
    client: RegistryClient, repo: str, form: LazyForm, parents: Sequence[Path], command: str, workdir: Path, *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ProfileRun:  # fmt: skip
    """Run ``command`` over ``form`` (its blobs already in ``repo``), the layer's ancestors
    ``parents`` (local EROFS files, nearest first) below it, and return what it made the
    loader fetch of the data device.

    ``workdir``: an empty private directory on a local filesystem (the loader's mount
    and cache, the run's mount points). A command that fails still yields its profile
    (what it read until then) with its ``returncode``: the caller decides.
    :class:`ProfileUnavailable` when the run cannot happen here."""
    from .lazy import LazyError, LazyLayers, RemoteLayer

    if not command.strip():
        raise ProfileUnavailable("the profile command is empty: give the start-up to record, "
                                 "e.g. --profile 'python3 -c pass'", reason="empty command")  # fmt: skip
    if os.geteuid() != 0:
        raise ProfileUnavailable("recording a prefetch profile mounts the layer in new namespaces: push as root",
                                 reason="not root")  # fmt: skip
    headers = client.auth_headers(repo)
    meta = RemoteLayer(registry=client.base_url, repo=repo, headers=headers, **form.meta.model_dump())
    data = RemoteLayer(registry=client.base_url, repo=repo, headers=headers, **form.data.model_dump())
    # a unix socket's path must be short: the scratch directory's may not be
    sockdir = Path(tempfile.mkdtemp(prefix="prof-", dir=_short_dir()))
    loader = LazyLayers(workdir / "fuse", workdir / "cache", socket_path=sockdir / "s", read_deadline_s=120.0)
    try:
        try:
            loader.start()
            meta_path = loader.attach(meta, prefetch_all=True)
            data_path = loader.attach(data, prefetch_metadata=False, extents_of=meta.digest)
        except (LazyError, OSError) as exc:  # no FUSE here, the registry refusing ranges...
            raise ProfileUnavailable(f"the lazy form could not be loaded from the registry to run the profile: "
                                     f"{exc}", reason="loader") from exc  # fmt: skip
        # the same fetches as on an edge that has worked out the files' extents (a miss fetches
        # the rest of its file): wait for them, so the profile does not depend on a race
        deadline = time.monotonic() + 60
        while not loader.stats()["layers"].get(data.hex, {}).get("extents_known") and time.monotonic() < deadline:
            time.sleep(0.02)
        (workdir / "mnt").mkdir()
        returncode, seconds, output = run_over(meta_path, data_path, parents, command, workdir / "mnt",
                                               timeout_s=timeout_s)  # fmt: skip
    finally:
        loader.close()
        shutil.rmtree(sockdir, ignore_errors=True)
    cached = {p.name for p in (workdir / "cache" / "sha256").iterdir()} if (workdir / "cache" / "sha256").is_dir() \
        else set()  # fmt: skip
    chunks = tuple(i for i, d in enumerate(data.chunks) if d.removeprefix("sha256:") in cached)
    wire = sum(data.wire_range(i)[1] - data.wire_range(i)[0] for i in chunks)
    return ProfileRun(command=command, returncode=returncode, seconds=seconds, output_tail=output[-2000:],
                      chunks=chunks, bytes_fetched=wire)  # fmt: skip


def _short_dir() -> str:
    root = Path("/run/dsec")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return tempfile.gettempdir()
    return os.fspath(root)


def run_over(meta: Path, data: Path, parents: Sequence[Path], command: str, workdir: Path, *,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, float, str]:  # fmt: skip
    """Mount ``meta`` with ``device=data`` (and ``parents`` below) in private namespaces and
    run ``/bin/sh -c command`` chrooted there; ``(exit status, seconds, output)``."""
    args = {"meta": os.fspath(meta), "data": os.fspath(data), "parents": [os.fspath(p) for p in parents],
            "work": os.fspath(workdir), "command": command}  # fmt: skip
    cmd = ["unshare", "--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "--propagation", "private",
           "--kill-child", sys.executable, "-m", "dsec.images.lazyprofile", json.dumps(args)]  # fmt: skip
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    except FileNotFoundError as exc:
        raise ProfileUnavailable("unshare(1) is not installed (util-linux)", reason="no unshare") from exc
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # --kill-child takes the namespace's processes along
        proc.communicate()
        raise ProfileUnavailable(f"the profile command {command!r} ran longer than {timeout_s:.0f} s and was killed; "
                                 "profile a start-up, not a whole workload (or raise --profile-timeout)",
                                 reason="timeout") from None  # fmt: skip
    seconds = round(time.monotonic() - t0, 3)
    text = out.decode(errors="replace")
    if proc.returncode == _SETUP_FAILED:
        raise ProfileUnavailable(f"the profile run could not be set up: {text.strip()[-2000:]}", reason="setup")
    return proc.returncode, seconds, text


def as_runs(indexes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Sorted chunk indexes as ``(first, count)`` runs."""
    runs: list[tuple[int, int]] = []
    for i in indexes:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return tuple(runs)


# ----------------------------------------------------------------- the child --


def _child(args: dict[str, object]) -> None:
    from dsec.images import sysmount

    work = Path(str(args["work"]))
    parents = [str(p) for p in args["parents"]]  # type: ignore[attr-defined]
    ro = sysmount.MS_RDONLY | sysmount.MS_NODEV | sysmount.MS_NOSUID
    lowers = []
    for i, (src, opts) in enumerate([(str(args["meta"]), f"device={args['data']}"), *((p, None) for p in parents)]):
        d = work / f"l{i}"
        d.mkdir()
        sysmount.mount(src, os.fspath(d), "erofs", ro, opts)
        lowers.append(os.fspath(d))
    rw, root = work / "rw", work / "root"
    rw.mkdir()
    root.mkdir()
    sysmount.mount("tmpfs", os.fspath(rw), "tmpfs", 0, "size=1g,mode=0755")
    (rw / "u").mkdir()
    (rw / "w").mkdir()
    sysmount.mount("overlay", os.fspath(root), "overlay", 0,
                   f"lowerdir={':'.join(lowers)},upperdir={rw / 'u'},workdir={rw / 'w'}")  # fmt: skip
    for sub in ("proc", "dev", "tmp"):
        (root / sub).mkdir(exist_ok=True)
    sysmount.mount("proc", os.fspath(root / "proc"), "proc", sysmount.MS_NOSUID | sysmount.MS_NODEV)
    sysmount.mount("tmpfs", os.fspath(root / "dev"), "tmpfs", sysmount.MS_NOSUID, "mode=0755,size=64k")
    for name in _DEVICES:
        (root / "dev" / name).touch()
        sysmount.mount(f"/dev/{name}", os.fspath(root / "dev" / name), "", _MS_BIND)
    os.chroot(root)
    os.chdir("/")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dsec.images.lazyprofile ARGS_JSON``: under ``unshare``, pid 1 of its namespace."""
    argv = sys.argv[1:] if argv is None else argv
    args = json.loads(argv[0])
    try:
        _child(args)
    except Exception as exc:  # reported to the parent by exit status and text
        print(f"setting up the profile mounts: {exc}", flush=True)
        os._exit(_SETUP_FAILED)
    env = {"PATH": _PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb"}
    shell = "/bin/sh"
    if not os.path.exists(shell):
        print(f"the layer has no {shell} to run the profile command {shlex.quote(str(args['command']))}", flush=True)
        os._exit(_SETUP_FAILED)
    os.execve(shell, [shell, "-c", str(args["command"])], env)


if __name__ == "__main__":
    main()
