"""What the compat benches share (:mod:`dsec.bench.compat`, :mod:`dsec.bench.compat_languages`,
:mod:`dsec.bench.e2b`): an all-in-one ``dsec up`` to measure against, the toolchain layers'
cache, and samples taken in turn."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

Say = Callable[[str], None]


def _quiet(_msg: str) -> None:
    return None


def toolchain_cache() -> Path:
    return Path(os.environ.get("DSEC_STATE_DIR") or "/var/lib/dsec") / "cache" / "toolchain-layers"



@contextlib.contextmanager
def all_in_one(work: Path, say: Say = _quiet, label: str = "compat",
               extra: Sequence[str] = ()) -> Iterator[tuple[str, str, int]]:
    """``dsec up`` on ``work`` (its layers already there); yields (url, admin token, its pid)
    once every edge has registered; stopped with Ctrl-C (which destroys its sandboxes)."""
    from dsec.cli.up import READY_FILE

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    log = open(work / "up.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "dsec.cli.main", "up", "--data-dir", str(work), "--port",
                             str(port), *extra], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        ready = work / READY_FILE
        deadline = time.monotonic() + 120
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dsec up did not become ready: see {work / 'up.log'}")
            time.sleep(0.1)
        say(f"{label}: dsec up on port {port} ({work})")
        yield f"http://127.0.0.1:{port}", (work / "control" / "admin.token").read_text().strip(), proc.pid
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _alternating(n: int, *calls: Callable[[], float], warm: int = 2) -> list[list[float]]:
    """``n`` samples of each call, taken in turn (so a change of the host's load hits both
    alike), after ``warm`` unmeasured rounds."""
    out: list[list[float]] = [[] for _ in calls]
    for i in range(warm + n):
        for samples, call in zip(out, calls, strict=True):
            ms = call()
            if i >= warm:
                samples.append(ms)
    return out


__all__ = ["Say", "_alternating", "_quiet", "all_in_one", "toolchain_cache"]
