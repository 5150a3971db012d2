"""Debian base trees with debootstrap, using the mirror apt already uses.

Owns: choosing a mirror (from apt's own sources, read by :mod:`.aptsources`, unless one
is given), running
``debootstrap`` into a staging directory, and slimming the result. Never
hard-codes a mirror host: this machine may reach Debian only through the
mirror its apt configuration names. debootstrap mounts /proc, /sys and maybe
device nodes inside its target; it runs in a private mount namespace
(``unshare --mount``) so none of those mounts can outlive it or leak to the
host.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from dsec.errors import HostError, InvalidSpec

from .aptsources import ETC_APT, AptSource, apt_sources, pick_source, where
from .errors import LayerBuildError
from .fsutil import remove_tree

_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")
_SUITE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")
_VARIANTS = ("minbase", "buildd", "fakechroot", "-")


@dataclass(frozen=True)
class Mirror:
    uri: str
    keyring: str | None = None
    origin: str = field(default="", compare=False)


def find_mirror(suite: str, *, etc_apt: Path = ETC_APT) -> Mirror:
    """The mirror apt uses for ``suite`` (or, failing that, the host's Debian archive mirror):
    :func:`dsec.images.aptsources.pick_source`, the same choice the set-up scripts make."""
    s = pick_source(suite, apt_sources(etc_apt))
    if s is not None:
        return Mirror(uri=s.uri.rstrip("/"), keyring=s.signed_by, origin=s.origin)
    raise LayerBuildError(
        f"no Debian mirror for {suite!r} in apt's sources ({where(etc_apt)}); pass one with --mirror URL",
        stage="debootstrap",
    )


# Paths removed after debootstrap: downloaded packages, apt lists, docs and
# non-C locales weigh more than half of a minbase tree and no sandbox needs them.
def slim_rootfs(root: Path) -> int:
    """Delete caches, docs, man pages, non-C locales and logs; return bytes freed."""
    freed = 0

    def rm(p: Path) -> None:
        nonlocal freed
        freed += _du(p)
        remove_tree(p)

    def children(p: Path) -> list[Path]:
        return sorted(p.iterdir()) if p.is_dir() and not p.is_symlink() else []

    for p in children(root / "var/cache/apt/archives"):
        if p.suffix == ".deb":
            rm(p)
    for p in children(root / "var/cache/apt"):
        if p.suffix == ".bin":
            rm(p)
    for p in children(root / "var/lib/apt/lists"):
        if p.name not in ("partial", "lock"):
            rm(p)
    for sub in ("usr/share/doc", "usr/share/man", "usr/share/info"):
        for p in children(root / sub):
            rm(p)
    for p in children(root / "usr/share/locale"):
        if p.name != "C" and not p.name.startswith("C.") and p.name != "locale.alias":
            rm(p)
    for name in ("var/log/bootstrap.log", "var/log/dpkg.log", "var/log/alternatives.log",
                 "var/cache/ldconfig/aux-cache", "var/cache/debconf/templates.dat-old",
                 "var/cache/debconf/config.dat-old"):  # fmt: skip
        p = root / name
        if p.is_file() or p.is_symlink():
            rm(p)
    for p in children(root / "var/log/apt"):
        rm(p)
    return freed


NEUTRAL_HOSTNAME = "localhost\n"
NEUTRAL_HOSTS = (
    "127.0.0.1\tlocalhost\n"
    "::1\tlocalhost ip6-localhost ip6-loopback\n"
    "fe00::0\tip6-localnet\n"
    "ff00::0\tip6-mcastprefix\n"
    "ff02::1\tip6-allnodes\n"
    "ff02::2\tip6-allrouters\n"
)
"""What a built layer's /etc/hostname and /etc/hosts say: nothing of the build machine
(Docker's lines for /etc/hosts). Every sandbox gets its own pair at create, these lines
plus its hostname (dsec.backends.common.identity), whatever its image holds."""


def scrub_build_host(root: Path, *, add_missing: bool = True) -> list[str]:
    """Take out of a built tree what the build copied or wrote from the build machine.

    debootstrap copies the host's ``/etc/hostname`` and ``/etc/resolv.conf`` into
    its target; package scripts may write a machine-id, ssh host keys or a random
    seed; apt and dpkg leave their lists, caches and logs. A layer built with them
    would hand the build machine's name, resolver and identity to every sandbox
    (and every sandbox the same "unique" ids). So: ``/etc/hostname`` (when present)
    becomes :data:`NEUTRAL_HOSTNAME`, and ``/etc/hosts`` :data:`NEUTRAL_HOSTS` — written
    when missing too (a debootstrap minbase has none, and a program run in the tree without
    a sandbox around it, in a chroot, should still resolve ``localhost``), unless
    ``add_missing`` is false (a toolkit's diff: its base has one); ``/etc/resolv.conf`` goes; ``/etc/machine-id`` (when
    present) is empty, as Debian images ship it (made at first boot);
    ``/var/lib/dbus/machine-id`` is a link to it; ssh host keys, random seeds,
    apt lists and caches, ``/tmp``, ``/var/tmp`` and shell history go; logs under
    ``/var/log`` go, and its login records (wtmp, btmp, lastlog, faillog) are
    emptied. Never follows a symlink out of ``root``. Returns the paths it
    changed, relative to ``root``.
    """
    changed: list[str] = []
    root = Path(os.path.realpath(root))

    def real_dir(rel: str) -> Path | None:
        """``root/rel`` if it is a directory reached without a symlink, else None."""
        p = root / rel
        return p if p.is_dir() and os.path.realpath(p) == str(p) else None

    def remove(rel: str) -> None:
        p = root / rel
        if real_dir(os.path.dirname(rel)) is not None and os.path.lexists(p):
            remove_tree(p)
            changed.append(rel)

    def replace(rel: str, text: str, mode: int) -> None:
        p = root / rel
        if (os.path.lexists(p) and not p.is_symlink() and p.is_file() and p.read_bytes() == text.encode()
                and p.stat().st_mode & 0o7777 == mode):
            return
        remove_tree(p)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            os.write(fd, text.encode())
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        changed.append(rel)

    def clear_dir(rel: str, keep: tuple[str, ...] = ()) -> None:
        d = real_dir(rel)
        if d is None:
            return
        for child in sorted(d.iterdir()):
            if child.name not in keep:
                remove(f"{rel}/{child.name}")

    if real_dir("etc") is not None:
        for rel, text in (("etc/hostname", NEUTRAL_HOSTNAME), ("etc/hosts", NEUTRAL_HOSTS)):
            if os.path.lexists(root / rel) or (add_missing and rel == "etc/hosts"):
                replace(rel, text, 0o644)
        remove("etc/resolv.conf")
        if os.path.lexists(root / "etc/machine-id"):
            replace("etc/machine-id", "", 0o444)
        ssh = real_dir("etc/ssh")
        if ssh is not None:
            for key in sorted(ssh.glob("ssh_host_*")):
                remove(f"etc/ssh/{key.name}")
    dbus_id = root / "var/lib/dbus/machine-id"
    if real_dir("var/lib/dbus") is not None and os.path.lexists(dbus_id) and not dbus_id.is_symlink():
        remove("var/lib/dbus/machine-id")
        os.symlink("/etc/machine-id", dbus_id)
    for seed in ("var/lib/systemd/random-seed", "var/lib/urandom/random-seed"):
        remove(seed)
    clear_dir("var/lib/apt/lists", keep=("partial", "lock"))
    clear_dir("var/lib/apt/lists/partial")
    clear_dir("var/cache/apt/archives", keep=("partial", "lock"))
    clear_dir("var/cache/apt/archives/partial")
    apt_cache = real_dir("var/cache/apt")
    if apt_cache is not None:
        for p in sorted(apt_cache.glob("*.bin")):
            remove(f"var/cache/apt/{p.name}")
    for rel in ("tmp", "var/tmp"):
        clear_dir(rel)
    for rel in ("root/.bash_history", "root/.wget-hsts", "root/.lesshst"):
        remove(rel)
    log_dir = real_dir("var/log")
    if log_dir is not None:
        for dirpath, _dirs, files in os.walk(log_dir):
            for f in sorted(files):
                p = Path(dirpath) / f
                rel = str(p.relative_to(root))
                if p.is_symlink() or not p.is_file():
                    remove(rel)
                elif f in ("wtmp", "btmp", "lastlog", "faillog"):
                    if p.stat().st_size:
                        os.truncate(p, 0)
                        changed.append(rel)
                else:
                    remove(rel)
    return changed


def _du(p: Path) -> int:
    try:
        st = p.lstat()
    except FileNotFoundError:
        return 0
    if not p.is_dir() or p.is_symlink():
        return st.st_size
    total = 0
    for dirpath, _dirs, files in os.walk(p):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


# One line per package: "I: Retrieving adduser 3.134", "I: Unpacking adduser...".
_PHASES = (
    (re.compile(r"^I: Retrieving \S+ \S+$"), "retrieve"),
    (re.compile(r"^I: Validating \S+ \S+$"), "validate"),
    (re.compile(r"^I: Extracting \S+\.\.\.$"), "extract"),
    (re.compile(r"^I: Unpacking \S+\.\.\.$"), "unpack"),
    (re.compile(r"^I: Configuring \S+\.\.\.$"), "configure"),
)


def debootstrap_phase(line: str) -> str | None:
    """The per-package phase a debootstrap output line reports, if any."""
    for pattern, phase in _PHASES:
        if pattern.match(line):
            return phase
    return None


def check_args(suite: str, variant: str, packages: Iterable[str]) -> list[str]:
    if not _SUITE.match(suite):
        raise InvalidSpec(
            f"bad Debian suite {suite!r}: e.g. bookworm, trixie, stable", field="suite"
        )
    if variant not in _VARIANTS:
        raise InvalidSpec(
            f"bad debootstrap variant {variant!r}: choose one of {', '.join(_VARIANTS)}",
            field="variant",
        )
    pkgs = [p.strip() for p in packages if p.strip()]
    for p in pkgs:
        if not _PACKAGE.match(p):
            raise InvalidSpec(f"bad Debian package name {p!r}", field="packages")
    return pkgs


def run_debootstrap(
    target: Path,
    *,
    suite: str,
    variant: str,
    packages: Iterable[str],
    mirror: Mirror,
    progress: Callable[[str, int, int | None], None] | None = None,
    timeout: float = 3600.0,
) -> None:
    """Run debootstrap into ``target`` (which must not exist or be empty)."""
    pkgs = check_args(suite, variant, packages)
    if os.geteuid() != 0:
        raise HostError("debootstrap needs root (it chroots and creates device nodes)")
    exe = shutil.which("debootstrap")
    unshare = shutil.which("unshare")
    if exe is None or unshare is None:
        raise HostError(
            "debootstrap and unshare are needed: apt-get install debootstrap util-linux",
            binary="debootstrap" if exe is None else "unshare",
        )
    cmd = [unshare, "--mount", "--propagation", "private", "--", exe, f"--variant={variant}"]
    if pkgs:
        cmd.append("--include=" + ",".join(pkgs))
    if mirror.keyring and Path(mirror.keyring).is_file():
        cmd.append(f"--keyring={mirror.keyring}")
    cmd += [suite, str(target), mirror.uri]
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "DEBIAN_FRONTEND": "noninteractive",
        "HOME": "/root",
    }
    tail: deque[str] = deque(maxlen=40)
    counts: dict[str, int] = {}
    total: int | None = None
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    timed_out = threading.Event()

    def _kill() -> None:
        timed_out.set()
        os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(timeout, _kill)
    watchdog.daemon = True
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            phase = debootstrap_phase(line)
            if phase is not None:
                counts[phase] = counts.get(phase, 0) + 1
                if phase == "validate":
                    total = counts.get("retrieve")
                if progress is not None:
                    n = counts[phase]
                    t = None if phase == "retrieve" or total is None else max(total, n)
                    progress(f"debootstrap: {phase}", n, t)
        rc = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if timed_out.is_set():
        raise LayerBuildError(
            f"debootstrap {suite} did not finish within {timeout:.0f} s and was killed; "
            "check that the mirror is reachable",
            stage="debootstrap",
        )
    if rc != 0:
        log_tail = ""
        log = target / "debootstrap" / "debootstrap.log"
        if log.is_file():
            log_tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise LayerBuildError(
            f"debootstrap {suite} from {mirror.uri} failed (exit {rc}):\n"
            + "\n".join(tail)
            + (f"\n--- debootstrap.log ---\n{log_tail}" if log_tail else "")
            + "\nCheck the mirror (--mirror URL), the suite name and the package names.",
            stage="debootstrap",
            returncode=rc,
        )


__all__ = [
    "NEUTRAL_HOSTNAME",
    "NEUTRAL_HOSTS",
    "AptSource",
    "Mirror",
    "apt_sources",
    "find_mirror",
    "run_debootstrap",
    "scrub_build_host",
    "slim_rootfs",
]
