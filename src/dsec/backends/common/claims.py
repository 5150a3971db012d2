"""Host-wide claims held with ``flock`` for a process's lifetime: what keeps two runtimes on
one host (two ``dsec up`` instances, two edges) from using the same host resources.

A claim is a file in the host's claims directory (:func:`claims_dir`: ``/run/dsec/claims``,
or ``$DSEC_CLAIMS_DIR``; one per host whatever ``run_dir`` a runtime uses, since cgroups,
links, tables and routes are host-wide) locked with ``flock``:

- ``runtime-<name>``: the runtime's name, which names its cgroups, run directory,
  records, writable-layer store and swap label (exclusive);
- ``nettag-<tag>``: the 4-hex tag of that name in its host network objects (links
  ``dsec-<tag>…``, tables ``dsec_host_<tag>``), whose 16 bits two names may share
  (exclusive: a second runtime with the same tag is refused, not merged);
- ``subnet-<a.b.c.d>_<len>``: a sandbox subnet. A subnet picked automatically is held
  exclusively; one given in a config is held shared, so edges configured alike may share
  it (addresses are then claimed from the kernel one /32 route at a time).

The kernel drops a lock when its holder dies, so a crashed owner never blocks the next
one. The last holder unlinks its file before it lets go, and a runtime that starts removes
the files of holders that died without letting go (SIGKILL), so nothing accumulates; a locker
checks that the file it locked is still the one at the path (else it lost a race with
such an unlink and tries again). Every lock is taken with LOCK_NB: a held claim is an
error that names its holder, never a wait. Only this module reads /proc/net/route.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from dsec.errors import HostError

DEFAULT_CLAIMS_DIR: Final = Path("/run/dsec/claims")
AUTO: Final = "auto"
"""``NetworkConfig.subnet`` value asking for :func:`pick_subnet`."""
AUTO_CANDIDATES: Final = tuple(ipaddress.IPv4Network(f"10.{b}.0.0/16") for b in range(224, 255))
"""Where an automatic subnet comes from: 31 /16s at the top of 10/8, clear of what Docker
(172.17-31, 192.168), most home networks and Kubernetes' service and k3s ranges (10.42-43,
10.96-111) use, and of 10.213-10.223, which DSec's examples and tests configure by hand.
(A host that routes one of them, such as a flannel node's 10.244/16, has it skipped.)"""


def claims_dir() -> Path:
    """The host's claims directory: ``$DSEC_CLAIMS_DIR`` or /run/dsec/claims."""
    return Path(os.environ.get("DSEC_CLAIMS_DIR") or DEFAULT_CLAIMS_DIR)


@dataclass
class Claim:
    """A held claim; :meth:`release` (or the process's death) lets it go."""

    path: Path
    fd: int
    shared: bool = False

    def release(self) -> None:
        if self.fd >= 0:
            last = not self.shared
            if self.shared:  # the last sharer removes the file: it alone can make its lock exclusive
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    last = True
                except BlockingIOError:
                    pass
            if last and self.intact():
                with contextlib.suppress(OSError):
                    self.path.unlink()  # while still locked: see the module docstring
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = -1

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def intact(self) -> bool:
        """The file at ``path`` is still the one locked (a removed file lets another process
        make a new one and lock it)."""
        if self.fd < 0:
            return False
        try:
            a, b = os.fstat(self.fd), os.stat(self.path)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _open(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def try_claim(path: Path, owner: str, *, shared: bool = False) -> Claim | None:
    """Lock ``path`` (exclusively, or shared); None when someone else holds it. An exclusive
    holder writes ``owner`` and its pid into the file, for the messages of the refused."""
    for _ in range(16):
        fd = _open(path)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        claim = Claim(path, fd, shared)
        if not claim.intact():  # its holder unlinked it between our open and our lock
            os.close(fd)
            continue
        if not shared:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{owner} pid {os.getpid()}\n".encode(), 0)
        return claim
    return None


def holder(path: Path) -> str:
    """Who holds an exclusive claim, as its file says ("" when unknown)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _conflicts(path: Path, mode: int) -> bool:
    """Whether a lock of ``mode`` on ``path`` would wait (someone holds a conflicting one)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the probe's own lock


def _held_by_someone(path: Path) -> bool:
    """Whether any process holds a lock (shared or exclusive) on ``path``."""
    return _conflicts(path, fcntl.LOCK_EX)


def _held_exclusively(path: Path) -> bool:
    """Whether a process holds an exclusive lock on ``path``."""
    return _conflicts(path, fcntl.LOCK_SH)


def net_tag(runtime: str) -> str:
    """The 4-hex tag of a runtime's name in its host network objects (15-char link names)."""
    return hashlib.sha256(runtime.encode()).hexdigest()[:4]


def sweep_dead(claims_dir: Path) -> int:
    """Remove the claim files no process holds: those of holders that died without releasing
    (SIGKILL), which cannot unlink their own. Each is unlinked while locked by us, as a release
    does, so a process that opened it meanwhile sees it was removed and tries again. Returns
    how many went."""
    n = 0
    try:
        names = os.listdir(claims_dir)
    except OSError:
        return 0
    for name in names:
        path = claims_dir / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if Claim(path, fd).intact():
                path.unlink()
                n += 1
        except OSError:  # held (BlockingIOError) or gone: leave it
            pass
        finally:
            os.close(fd)
    return n


def claim_runtime(claims_dir: Path, name: str) -> list[Claim]:
    """The claims of runtime ``name``: its name and its network tag. HostError, naming the
    holder, when another process on this host has either. Claim files of dead holders are
    swept first (:func:`sweep_dead`)."""
    sweep_dead(claims_dir)
    got: list[Claim] = []
    try:
        for path, what in ((claims_dir / f"runtime-{name}", f"runtime name {name!r}"),
                           (claims_dir / f"nettag-{net_tag(name)}", f"network tag {net_tag(name)} of {name!r}")):
            c = try_claim(path, name)
            if c is None:
                raise HostError(
                    f"{what} is in use by another process on this host ({holder(path) or 'unknown'}, lock {path}): "
                    "stop it, or give this one another name (EdgeConfig.runtime_name, `dsec up --node-name`)",
                    path=str(path), holder=holder(path))
            got.append(c)
    except BaseException:
        for c in got:
            c.release()
        raise
    return got


# ----- subnets -----


def _subnet_path(claims_dir: Path, net: ipaddress.IPv4Network) -> Path:
    return claims_dir / f"subnet-{net.network_address}_{net.prefixlen}"


def _claimed_subnets(claims_dir: Path) -> list[tuple[ipaddress.IPv4Network, Path]]:
    out = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(claims_dir):
            if entry.name.startswith("subnet-"):
                with contextlib.suppress(ValueError):
                    out.append((ipaddress.IPv4Network(entry.name[7:].replace("_", "/")), Path(entry.path)))
    return out


def host_routes(route_file: Path = Path("/proc/net/route")) -> list[tuple[ipaddress.IPv4Network, str]]:
    """IPv4 routes of the main table, (network, interface), without the default route."""
    out: list[tuple[ipaddress.IPv4Network, str]] = []
    try:
        lines = route_file.read_text().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        f = line.split()
        if len(f) < 8:
            continue
        dest = ipaddress.IPv4Address(int(f[1], 16).to_bytes(4, "little"))
        mask = ipaddress.IPv4Address(int(f[7], 16).to_bytes(4, "little"))
        with contextlib.suppress(ValueError):
            net = ipaddress.IPv4Network(f"{dest}/{mask}", strict=False)
            if net.prefixlen > 0:
                out.append((net, f[0]))
    return out


def claim_subnet(claims_dir: Path, subnet: str, owner: str) -> Claim:
    """A shared claim on a configured subnet; HostError when an automatic pick of another
    instance holds it or a subnet overlapping it."""
    net = ipaddress.IPv4Network(subnet)
    for other, path in _claimed_subnets(claims_dir):
        if other != net and other.overlaps(net) and _held_exclusively(path):
            raise HostError(f"network.subnet {net} overlaps {other}, which another DSec instance on this host "
                            f"uses ({holder(path) or 'unknown'}): choose another subnet, or \"auto\"", subnet=str(net))
    path = _subnet_path(claims_dir, net)
    for _ in range(20):  # a picker's probe holds it for a moment: only an owner holds it for long
        c = try_claim(path, owner, shared=True)
        if c is not None:
            return c
        time.sleep(0.01)
    raise HostError(f"network.subnet {net} is in use by another DSec instance on this host "
                    f"({holder(path) or 'unknown'}): choose another subnet, or \"auto\"", subnet=str(net))


def pick_subnet(claims_dir: Path | None, owner: str, *, own_links: str, keep: Sequence[str] = (),
                routes: Iterable[tuple[ipaddress.IPv4Network, str]] | None = None) -> tuple[str, Claim | None]:
    """A /16 of :data:`AUTO_CANDIDATES` that no other instance holds and the host does not
    route, claimed exclusively. ``keep``: addresses of sandboxes that survived a restart
    (their subnet is taken again); ``own_links``: the prefix of this runtime's links, whose
    routes are its own sandboxes'. The search starts at a place given by ``owner``, so two
    instances rarely even try the same one; a subnet only covered by a broader route
    (a VPN's 10.0.0.0/8) is taken when nothing else is free."""
    routed = [(n, dev) for n, dev in (host_routes() if routes is None else routes) if not dev.startswith(own_links)]
    claimed = _claimed_subnets(claims_dir) if claims_dir is not None else []
    start = int(hashlib.sha256(owner.encode()).hexdigest(), 16) % len(AUTO_CANDIDATES)
    order = list(AUTO_CANDIDATES[start:] + AUTO_CANDIDATES[:start])
    keep_ips = [ipaddress.IPv4Address(a) for a in keep]
    order.sort(key=lambda n: not any(ip in n for ip in keep_ips))  # a survivor's subnet first
    refusals: list[str] = []
    for broad_ok in (False, True):
        for cand in order:
            clash = [f"{n} ({dev})" for n, dev in routed if n.overlaps(cand) and (n.prefixlen >= cand.prefixlen
                                                                                   or not broad_ok)]
            if clash:
                refusals.append(f"{cand}: routed on the host ({clash[0]})")
                continue
            busy = [str(n) for n, p in claimed if n.overlaps(cand) and n != cand and _held_by_someone(p)]
            if busy:
                refusals.append(f"{cand}: overlaps {busy[0]}, used by another instance")
                continue
            if claims_dir is None:
                return str(cand), None
            c = try_claim(_subnet_path(claims_dir, cand), owner)
            if c is not None:
                return str(cand), c
            refusals.append(f"{cand}: used by another instance")
    raise HostError(f"no free sandbox subnet among {AUTO_CANDIDATES[0]} .. {AUTO_CANDIDATES[-1]} "
                    f"({refusals[0] if refusals else 'none'}, ...): set network.subnet to a free range",
                    refusals=refusals[:8])


__all__ = ["AUTO", "AUTO_CANDIDATES", "DEFAULT_CLAIMS_DIR", "Claim", "claim_runtime", "claim_subnet", "claims_dir",
           "holder", "host_routes", "net_tag", "pick_subnet", "try_claim"]
