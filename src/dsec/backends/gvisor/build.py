"""Build (or locate) ``dsec-gvexec``, the in-sandbox helper of the gVisor backend.

A static binary (musl where installed, else static glibc) compiled from
``native/dsec-gvexec.c`` on first use, or when older than its source.
``DSEC_GVEXEC`` overrides the location. ``python -m dsec.backends.gvisor.build``
builds it ahead of time.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from dsec.backends.common.native import compile_c, fresh, overridden
from dsec.errors import HostError

NATIVE_DIR = Path(__file__).resolve().parent / "native"
SOURCE = NATIVE_DIR / "dsec-gvexec.c"
BINARY = NATIVE_DIR / "dsec-gvexec"
CFLAGS = ["-O2", "-Wall", "-Wextra", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong", "-static"]


def helper_path(*, build: bool = True) -> Path:
    override = overridden("DSEC_GVEXEC")
    if override is not None:
        return override
    if not fresh({BINARY: [SOURCE]}):
        if not build:
            raise HostError(f"{BINARY} is missing; run `python -m dsec.backends.gvisor.build`")
        compile_helper()
    return BINARY


def compile_helper(out: Path = BINARY) -> Path:
    cc = shutil.which("musl-gcc") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise HostError("no C compiler: install gcc and musl-tools (scripts/setup.sh does)")
    return compile_c(cc, CFLAGS, [SOURCE], out, what="dsec-gvexec",
                     hint="a static libc is needed: musl-tools or libc6-dev")


if __name__ == "__main__":
    try:
        print(f"dsec-gvexec: {helper_path()}")
    except HostError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
