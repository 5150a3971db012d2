"""A Python 3.13 with the released harbor (which needs Python >= 3.12; this machine's is
3.11), for the Harbor tests: Debian trixie made by debootstrap, harbor installed into a
venv in it from PyPI (uv: pip's resolver backtracks for minutes over harbor's tree), all
cached; commands run chrooted in a mount namespace of their own (nothing stays mounted),
on the host's network (so they reach a `dsec up` on loopback), with this repository
bind-mounted read-only at /dsec (DSec itself comes from /dsec/src).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

HARBOR = "0.26.0"
PACKAGES = ("python3", "python3-venv", "ca-certificates")
REPO = Path(__file__).resolve().parents[2]
CA = "/etc/dsec-host-ca/ca.crt"


def available(cache: Path) -> str | None:
    """Why the Harbor environment cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (debootstrap, chroot, mount namespaces)"
    if (root_dir(cache) / ".dsec-complete").exists():
        return None
    for tool in ("debootstrap", "unshare", "chroot"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    return None


def root_dir(cache: Path) -> Path:
    return cache / f"harbor-{HARBOR}-trixie"


def harbor_root(cache: Path, say: object = print) -> Path:
    """The chroot with /venv holding harbor (made once: debootstrap and an install, ~2 min)."""
    from dsec.images.debootstrap import find_mirror, run_debootstrap

    root = root_dir(cache)
    done = root / ".dsec-complete"
    if done.exists():
        return root
    if root.exists():
        shutil.rmtree(root)
    cache.mkdir(parents=True, exist_ok=True)
    print(f"harbor: debootstrap trixie into {root} (once)")
    run_debootstrap(root, suite="trixie", variant="minbase", packages=PACKAGES, mirror=find_mirror("trixie"))
    # The host's resolver and CA bundle: PyPI is reached as the host reaches it.
    shutil.copyfile("/etc/resolv.conf", root / "etc/resolv.conf")
    (root / CA.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile("/etc/ssl/certs/ca-certificates.crt", root / CA.lstrip("/"))
    print(f"harbor: installing harbor=={HARBOR} into {root}/venv")
    run(root, "python3 -m venv /venv && /venv/bin/pip install -q uv && "
              f"/venv/bin/uv pip install -q --python /venv/bin/python harbor=={HARBOR} httptools sniffio",
        timeout=1200, check=True)
    done.write_text("ok\n")
    return root


def run(root: Path, script: str, *, binds: dict[str, str] | None = None, env: dict[str, str] | None = None,
        timeout: float = 600, check: bool = False) -> subprocess.CompletedProcess[str]:
    """``script`` under /bin/sh in the chroot; ``binds``: host path -> path inside (made
    if missing). The repository is always at /dsec (read-only)."""
    mounts = [f"mount -t proc proc {shlex.quote(str(root / 'proc'))}"]
    for host, inside in {str(REPO): "/dsec", **(binds or {})}.items():
        target = shlex.quote(str(root / inside.lstrip("/")))
        mounts.append(f"mkdir -p {target} && mount --bind {shlex.quote(host)} {target}")
    mounts.append(f"mount -o remount,bind,ro {shlex.quote(str(root / 'dsec'))}")
    inner_env = {"PATH": "/venv/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "PIP_CERT": CA,
                 "SSL_CERT_FILE": CA, "PYTHONPATH": "/dsec/src", "PYTHONDONTWRITEBYTECODE": "1",
                 # no traffic off this host: Harbor's usage telemetry, litellm's price list
                 "HARBOR_TELEMETRY": "0", "LITELLM_LOCAL_MODEL_COST_MAP": "True", **(env or {})}
    chroot = ["chroot", str(root), "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in inner_env.items()),
              "/bin/sh", "-c", script]
    outer = " && ".join(mounts) + " && exec " + shlex.join(chroot)
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "--fork", "--", "sh", "-c", outer],
                          capture_output=True, text=True, timeout=timeout, check=check)
