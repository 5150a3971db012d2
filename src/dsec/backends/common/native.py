"""The backends' native helpers (C, compiled with the machine's compiler on first use).

A helper is located in this order: the environment variable that overrides it, else the
binary beside its sources, compiled first when it is missing or older than any of them.
A compile writes a temporary file and renames it over the binary, so a process starting
the helper meanwhile never runs half of one. Runs the compiler (blocking): call from a
thread, or before the event loop matters.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from dsec.errors import HostError


def overridden(env_var: str) -> Path | None:
    """The binary ``env_var`` names (HostError unless it is executable); None when unset."""
    value = os.environ.get(env_var)
    if not value:
        return None
    if not os.access(value, os.X_OK):
        raise HostError(f"{env_var}={value} is not an executable file", path=value)
    return Path(value)


def fresh(inputs: Mapping[Path, Sequence[Path]]) -> bool:
    """Every binary exists and is no older than each file it is built from."""
    return all(b.exists() and all(b.stat().st_mtime >= src.stat().st_mtime for src in srcs)
               for b, srcs in inputs.items())


def compile_c(cc: str, flags: Sequence[str], sources: Sequence[Path], out: Path, *, what: str, hint: str,
              libs: Sequence[str] = ()) -> Path:
    """``cc flags -o out sources libs``, through a temporary file renamed over ``out``.
    HostError naming ``what`` (with ``hint``: what to install) and the compiler's errors
    when it fails; its warnings are printed on stderr (the sources keep -Wall -Wextra clean)."""
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    cmd = [cc, *flags, "-o", str(tmp), *map(str, sources), *libs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise HostError(f"building {what} failed ({hint}):\n{proc.stderr.strip()}", command=" ".join(cmd))
    if proc.stderr.strip():
        print(f"{what}: compiler warnings:\n{proc.stderr.strip()}", file=sys.stderr)
    os.replace(tmp, out)
    return out
