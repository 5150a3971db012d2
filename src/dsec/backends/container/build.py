"""Build (or locate) the native ``dsec-spawner`` helper with the machine's gcc.

Run by ``scripts/setup.sh`` (``python -m dsec.backends.container.build``) and,
as a convenience, on first use when a binary is missing or older than any of
its sources. ``DSEC_SPAWNER`` overrides the location.

The spawner is every ``native/*.c`` but ``dsec-init.c`` (they share
``native/spawner.h``); ``dsec-init.c`` is the sandboxes' static pid 1.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from dsec.backends.common.native import compile_c, fresh, overridden
from dsec.errors import HostError

NATIVE_DIR = Path(__file__).resolve().parent / "native"
BINARY = NATIVE_DIR / "dsec-spawner"
INIT_SOURCE = NATIVE_DIR / "dsec-init.c"
INIT_BINARY = NATIVE_DIR / "dsec-init"
"""The sandboxes' pid 1, static, exec'd by the spawner from beside its own binary."""
CFLAGS = ["-O2", "-Wall", "-Wextra", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong"]


def spawner_sources() -> list[Path]:
    """The spawner's C files (sorted: the same command line every time)."""
    return sorted(p for p in NATIVE_DIR.glob("*.c") if p != INIT_SOURCE)


def _inputs() -> dict[Path, list[Path]]:
    """Each binary and every file it is built from (a header change rebuilds the spawner)."""
    return {BINARY: [*spawner_sources(), *sorted(NATIVE_DIR.glob("*.h"))], INIT_BINARY: [INIT_SOURCE]}


def spawner_path(*, build: bool = True) -> Path:
    """Return the spawner binary, compiling it first if it is missing or stale."""
    override = overridden("DSEC_SPAWNER")
    if override is not None:
        return override
    if not fresh(_inputs()):
        if not build:
            raise HostError(
                f"{BINARY} is missing; run `bash scripts/setup.sh` or `python -m dsec.backends.container.build`"
            )
        compile_spawner()
    return BINARY


def compile_spawner(out: Path = BINARY) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise HostError("no C compiler: install gcc (apt-get install gcc libc6-dev libseccomp-dev)")
    compile_c(gcc, CFLAGS, spawner_sources(), out, libs=["-lseccomp"], what="dsec-spawner",
              hint="is libseccomp-dev installed?")
    # musl where installed: ~12 KiB resident and fewer page tables per sandbox than a static
    # glibc binary (an init per sandbox: 10,000 on a dense node).
    compile_c(shutil.which("musl-gcc") or gcc, [*CFLAGS, "-static"], [INIT_SOURCE], out.with_name(INIT_BINARY.name),
              what="dsec-init", hint="static libc: apt-get install libc6-dev")
    return out


if __name__ == "__main__":
    try:
        print(f"dsec-spawner: {spawner_path()}")
    except HostError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
