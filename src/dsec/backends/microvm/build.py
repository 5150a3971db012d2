"""Build (or locate) ``dsec-vmagent``, the microVM guest's init and agent.

A static binary compiled with musl-gcc (static glibc as a fallback) from
``native/dsec-vmagent.c`` and ``native/vmwire.c`` on first use, or when older
than its sources. It becomes ``/init`` of the guest's initramfs
(:mod:`dsec.backends.microvm.guest`). ``DSEC_VMAGENT`` overrides the location;
``python -m dsec.backends.microvm.build`` builds it ahead of time.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from dsec.backends.common.native import compile_c, fresh, overridden
from dsec.errors import HostError

NATIVE_DIR = Path(__file__).resolve().parent / "native"
SOURCES = [NATIVE_DIR / "dsec-vmagent.c", NATIVE_DIR / "vmwire.c"]
HEADERS = [NATIVE_DIR / "vmagent.h"]
BINARY = NATIVE_DIR / "dsec-vmagent"
CFLAGS = ["-O2", "-Wall", "-Wextra", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong", "-static"]


def agent_path(*, build: bool = True) -> Path:
    override = overridden("DSEC_VMAGENT")
    if override is not None:
        return override
    if not fresh({BINARY: [*SOURCES, *HEADERS]}):
        if not build:
            raise HostError(f"{BINARY} is missing; run `python -m dsec.backends.microvm.build`")
        compile_agent()
    return BINARY


def compile_agent(out: Path = BINARY) -> Path:
    cc = shutil.which("musl-gcc") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise HostError("no C compiler: install gcc and musl-tools (scripts/setup.sh does)")
    return compile_c(cc, CFLAGS, SOURCES, out, what="dsec-vmagent",
                     hint="a static libc is needed: musl-tools or libc6-dev")


if __name__ == "__main__":
    try:
        print(f"dsec-vmagent: {agent_path()}")
    except HostError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
