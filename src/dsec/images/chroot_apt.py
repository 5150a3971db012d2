"""Install Debian packages over a base layer, keeping only what they change (a toolkit's diff).

The one privileged step of a toolchain build (toolchains.py), run as a process of its
own inside fresh mount and pid namespaces::

    unshare --mount --pid --fork --propagation private -- \\
        python -m dsec.images.chroot_apt --base LAYER.erofs [--base OVER.erofs] --dir SCRATCH --packages a,b

In there it mounts the base layer (file-backed EROFS, read-only; for a library layer, the
toolkit it goes over as well) under an overlay whose
upper directory is ``SCRATCH/upper``, gives the merged tree a /proc, the host's /dev and
tmpfs on the paths whose content must not end up in the layer (/tmp, apt's lists and
downloaded packages), and runs ``apt-get update`` and ``apt-get install
--no-install-recommends`` chrooted into it with the host's network and resolver. What the
packages add, replace or delete is then exactly the upper directory (whiteouts included).
The overlay is mounted without redirects, metacopy or an index, so that directory is a
plain diff that reads the same stacked over the base as an EROFS lower.

Owns nothing outside its namespaces: every mount dies with it (the parent's mount table
never sees one), and so does any daemon a package script starts (it is pid 1 of its pid
namespace). Must never be imported by a long-lived process for its side effects: it only
does anything through :func:`main`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from .sysmount import MS_NODEV, MS_NOSUID, MS_RDONLY, mount, umount

MS_BIND = 0x1000
MS_REC = 0x4000
MS_NOEXEC = 0x8
MNT_DETACH = 0x2

APT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
    "DEBCONF_NONINTERACTIVE_SEEN": "true",
    "HOME": "/root",
}
POLICY_RC_D = "#!/bin/sh\n# dsec toolchain build: no service starts while packages install\nexit 101\n"
SCRATCH_TMPFS = ("tmp", "var/tmp", "var/lib/apt/lists", "var/cache/apt")
"""Mounted as tmpfs for the build: apt's lists, caches and downloads, and temporary files,
never reach the upper directory (so never the layer)."""


def _run(root: Path, argv: list[str], what: str) -> None:
    proc = subprocess.run(["chroot", str(root), *argv], env=APT_ENV, stdin=subprocess.DEVNULL,
                          stdout=sys.stdout, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        print(f"dsec-chroot-apt: {what} failed (exit {proc.returncode})", flush=True)
        raise SystemExit(10 + min(proc.returncode, 100))


def install(bases: list[Path], scratch: Path, packages: list[str], apt_options: list[str]) -> None:
    """``bases``: the lower layers, bottom first (the base, then e.g. the toolkit a library
    layer goes over)."""
    upper, work, root = (scratch / n for n in ("upper", "work", "root"))
    lowers = [scratch / f"lower{i}" for i in range(len(bases))]
    for d in (*lowers, upper, work, root):
        d.mkdir(exist_ok=True)
    os.chmod(upper, 0o755)
    for base, lower in zip(bases, lowers, strict=True):
        mount(str(base), str(lower), "erofs", MS_RDONLY | MS_NODEV)
    stack = ":".join(str(d) for d in reversed(lowers))  # overlayfs: topmost first
    mount("overlay", str(root), "overlay", 0,
          f"lowerdir={stack},upperdir={upper},workdir={work},redirect_dir=off,index=off,metacopy=off,xino=off")
    mount("proc", str(root / "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("/dev", str(root / "dev"), "", MS_BIND | MS_REC)
    for rel in SCRATCH_TMPFS:
        (root / rel).mkdir(parents=True, exist_ok=True)  # in the base already, normally
        mount("tmpfs", str(root / rel), "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    (root / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
    (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    os.chmod(root / "var/tmp", 0o1777)
    # Written through the overlay and removed the same way before the end: the base has
    # neither, so they leave no trace (no whiteout) in the upper directory.
    resolv = root / "etc/resolv.conf"
    resolv.unlink(missing_ok=True)
    resolv.write_bytes(Path("/etc/resolv.conf").read_bytes() if Path("/etc/resolv.conf").is_file() else b"")
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text(POLICY_RC_D)
    policy.chmod(0o755)
    opts = [f"-o{o}" for o in apt_options]
    try:
        _run(root, ["apt-get", *opts, "-q", "update"], "apt-get update")
        _run(root, ["apt-get", *opts, "-q", "-y", "--no-install-recommends", "install", *packages],
             "apt-get install " + " ".join(packages))
    finally:
        resolv.unlink(missing_ok=True)
        policy.unlink(missing_ok=True)
        for rel in (*reversed(SCRATCH_TMPFS), "dev", "proc"):
            umount(str(root / rel), MNT_DETACH)
        umount(str(root))  # flushes the upper directory; an error here must fail the build
        for lower in lowers:
            umount(str(lower), MNT_DETACH)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsec.images.chroot_apt", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, action="append", required=True,
                    help="a lower layer's EROFS file (repeat: bottom first)")
    ap.add_argument("--dir", type=Path, required=True, help="scratch directory: lower/, upper/, work/, root/")
    ap.add_argument("--packages", required=True, help="comma-separated Debian package names")
    ap.add_argument("--apt-option", action="append", default=[], help="KEY=VALUE for apt-get -o (repeatable)")
    args = ap.parse_args(argv)
    if os.getpid() != 1:
        print("dsec-chroot-apt: run me as pid 1 of fresh mount and pid namespaces (unshare --mount --pid --fork)",
              file=sys.stderr)
        return 2
    install(args.base, args.dir, [p for p in args.packages.split(",") if p], args.apt_option)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
