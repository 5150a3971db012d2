"""Build (or locate) ``dsec-gvexec``, the in-sandbox helper of the gVisor backend.

A static binary (musl where installed, else static glibc) compiled from
``native/dsec-gvexec.c`` on first use, or when older than its source.
``DSEC_GVEXEC`` overrides the location. ``python -m dsec.backends.gvisor.build``
builds it ahead of time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from dsec.errors import HostError

NATIVE_DIR = Path(__file__).resolve().parent / "native"
SOURCE = NATIVE_DIR / "dsec-gvexec.c"
BINARY = NATIVE_DIR / "dsec-gvexec"
CFLAGS = ["-O2", "-Wall", "-Wextra", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong", "-static"]


def helper_path(*, build: bool = True) -> Path:
    override = os.environ.get("DSEC_GVEXEC")
    if override:
        if not os.access(override, os.X_OK):
            raise HostError(f"DSEC_GVEXEC={override} is not an executable file", path=override)
        return Path(override)
    if not BINARY.exists() or BINARY.stat().st_mtime < SOURCE.stat().st_mtime:
        if not build:
            raise HostError(f"{BINARY} is missing; run `python -m dsec.backends.gvisor.build`")
        compile_helper()
    return BINARY


def compile_helper(out: Path = BINARY) -> Path:
    cc = shutil.which("musl-gcc") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise HostError("no C compiler: install gcc and musl-tools (scripts/setup.sh does)")
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    cmd = [cc, *CFLAGS, "-o", str(tmp), str(SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise HostError("building dsec-gvexec failed (a static libc is needed: musl-tools or libc6-dev):\n"
                        + proc.stderr.strip(), command=" ".join(cmd))
    if proc.stderr.strip():
        print(f"dsec-gvexec: compiler warnings:\n{proc.stderr.strip()}", file=sys.stderr)
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    try:
        print(f"dsec-gvexec: {helper_path()}")
    except HostError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
