"""Reconcile after SIGKILL: the process running a backend dies without a word; a new backend
object with the same context re-adopts what survived (``reconciled`` says so, exec works, its
files and processes are intact) and removes what was half made, so that after it closes
nothing of either is left on the host.

The backend runs in a ``python -c`` child built from the same config and context as the test
would build it (:data:`CHILD`), so this holds for any backend kind."""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.base import Capability

from .conftest import BackendHarness, Kind, context_name, make_context, wait_until

pytestmark = [pytest.mark.root, pytest.mark.timeout(120), pytest.mark.requires(Capability.SANDBOXES)]

SRC = Path(__file__).resolve().parents[2] / "src"

CHILD = r"""
import asyncio, importlib, json, sys
from pathlib import Path
from dsec.backends import BackendContext, build
from dsec.images import LocalLayerStore
from dsec.spec import SandboxSpec

a = json.loads(sys.argv[1])
module, _, cls = a["config_class"].rpartition(".")
config = getattr(importlib.import_module(module), cls).model_validate_json(a["config"])
ctx = BackendContext(name=a["name"], state_dir=Path(a["state_dir"]), run_dir=Path(a["run_dir"]),
                     id_prefix=a["id_prefix"], store=LocalLayerStore(Path(a["store"])), backends={})
spec = SandboxSpec.model_validate_json(a["spec"])

async def main():
    be = build(config, ctx)
    await be.start()
    print("started", flush=True)
    if a["mode"] == "settled":
        sid = a["ids"][0]
        await be.create(spec, sandbox_id=sid)
        r = await be.exec(sid, a["setup"], timeout=30)
        assert r.exit_code == 0, r
        print("created", sid, flush=True)
        print("READY", flush=True)
    elif a["mode"] == "fork":
        sid, kids = a["ids"][0], a["ids"][1:]
        await be.create(spec, sandbox_id=sid)
        r = await be.exec(sid, a["setup"], timeout=30)
        assert r.exit_code == 0, r
        print("created", sid, flush=True)
        print("forking", flush=True)
        await be.fork(sid, kids)
        print("FORK-DONE", flush=True)
    else:
        async def one(sid):
            print("creating", sid, flush=True)
            await be.create(spec, sandbox_id=sid)
            print("created", sid, flush=True)
        await asyncio.gather(*(one(s) for s in a["ids"]))
        print("BURST-DONE", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


class Child:
    """The backend's process, and the lines it printed."""

    def __init__(self, kind: Kind, ctx: Any, mode: str, ids: list[str], spec: Any, setup: str = "",
                 log: Path | None = None) -> None:
        args = {
            "config_class": f"{type(kind.config).__module__}.{type(kind.config).__qualname__}",
            "config": kind.config.model_dump_json(), "name": ctx.name, "state_dir": str(ctx.state_dir),
            "run_dir": str(ctx.run_dir), "id_prefix": ctx.id_prefix, "store": str(ctx.store.root),
            "spec": spec.model_dump_json(), "mode": mode, "ids": ids, "setup": setup,
        }
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
        self.log = open(log or os.devnull, "wb")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], stdout=subprocess.PIPE,
                                     stderr=self.log, env=env)
        self.lines: list[str] = []
        self._buf = b""

    def until(self, pred: Callable[[list[str]], bool], timeout: float) -> bool:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while not pred(self.lines):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return pred(self.lines)
            self._buf += chunk
            *done, self._buf = self._buf.split(b"\n")
            self.lines += [d.decode() for d in done]
        return True

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.until(lambda _: False, timeout=0.2)  # what it printed before it died
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()

    def ids(self, word: str) -> list[str]:
        return [ln.split()[1] for ln in self.lines if ln.startswith(word + " ")]


@pytest.fixture
def fresh(backend_kind: Kind, dsec_base: Path, busybox_seed: Path) -> Iterator[Callable[[str], BackendHarness]]:
    """``fresh(suffix)``: a harness, not started, on a context of its own (no backend of that
    name may run while the child does). On the way out it is started if it was not (to clean
    up what the child left), closed, and must have left nothing."""
    made: list[BackendHarness] = []

    def make(suffix: str) -> BackendHarness:
        ctx = make_context(dsec_base, context_name(backend_kind.name, suffix), busybox_seed)
        made.append(BackendHarness(backend_kind, ctx))
        return made[-1]

    yield make
    for h in made:
        if h.runner is None:
            h.start()
        h.close()
        assert wait_until(lambda h=h: not h.leftovers(), timeout=5), f"backend {h.name} left: {h.leftovers()}"


def test_a_sandbox_survives_its_backends_sigkill(fresh: Callable[[str], BackendHarness], dsec_base: Path) -> None:
    h = fresh("rcok")
    sid = f"cf-{secrets.token_hex(5)}"
    n = 10_000 + secrets.randbelow(80_000)
    setup = f"echo survived > /tmp/mark; sleep 7{n} >/dev/null 2>&1 &"
    child = Child(h.kind, h.ctx, "settled", [sid], h.spec(), setup, log=dsec_base / f"{h.name}.log")
    h.made.append(sid)
    try:
        assert child.until(lambda ls: "READY" in ls, timeout=60), (child.lines, (dsec_base / f"{h.name}.log")
                                                                    .read_text()[-3000:])
    finally:
        child.kill()
    assert child.ids("created") == [sid]
    h.start()
    assert sid in h.impl.reconciled.get("adopted", []), h.impl.reconciled
    assert sid not in h.impl.reconciled.get("destroyed", [])
    assert [r.id for r in h.impl.list()] == [sid]
    assert h.ok(sid, "cat /tmp/mark") == "survived\n"
    assert h.sandbox_processes(sid, f"sleep 7{n}"), "the sandbox's processes did not survive"
    assert h.ok(sid, "echo works") == "works\n"
    other = h.create()  # new sandboxes beside the adopted one
    assert h.ok(other.id, "echo new") == "new\n"
    assert h.run(h.impl.destroy(sid)) is True
    assert wait_until(lambda: not h.traces(sid), timeout=5), h.traces(sid)


def test_a_sigkill_mid_create_leaves_nothing_half_made(fresh: Callable[[str], BackendHarness],
                                                        dsec_base: Path) -> None:
    h = fresh("rcmid")
    ids = [f"cf-{secrets.token_hex(5)}" for _ in range(12)]
    h.made.extend(ids)
    log = dsec_base / f"{h.name}.log"
    child = Child(h.kind, h.ctx, "burst", ids, h.spec(), log=log)
    try:
        # Killed as the first create completes: the others are somewhere in the middle.
        assert child.until(lambda ls: any(ln.startswith("created ") for ln in ls), timeout=60), \
            (child.lines, log.read_text()[-3000:])
    finally:
        child.kill()
    created = child.ids("created")
    assert "BURST-DONE" not in child.lines and len(created) < len(ids), "nothing was in flight when killed"
    h.start()
    adopted = set(h.impl.reconciled.get("adopted", []))
    assert set(created) <= adopted, (created, h.impl.reconciled)
    assert adopted <= set(ids), h.impl.reconciled
    assert {r.id for r in h.impl.list()} == adopted
    for sid in adopted:  # whatever was adopted works
        assert h.ok(sid, "echo adopted") == "adopted\n"
    for sid in set(ids) - adopted:  # whatever was not has no trace left
        assert not h.traces(sid), (sid, h.traces(sid))
    print(f"in flight when killed: {len(ids) - len(created)}, adopted {len(adopted)}, "
          f"removed {len(set(ids) - adopted)}")



@pytest.mark.requires(Capability.FORK)
def test_a_sigkill_mid_fork_adopts_the_parent_and_leaves_no_half_made_child(
        fresh: Callable[[str], BackendHarness], dsec_base: Path) -> None:
    """The backend dies while it forks a sandbox into four: on restart the parent is adopted
    with its state, and each child is either whole (adopted, answering, with the parent's
    files) or gone without a trace."""
    h = fresh("rcfork")
    ids = [f"cf-{secrets.token_hex(5)}" for _ in range(5)]
    h.made.extend(ids)
    log = dsec_base / f"{h.name}.log"
    child = Child(h.kind, h.ctx, "fork", ids, h.spec(), "echo from-parent > /tmp/mark", log=log)
    try:
        assert child.until(lambda ls: "forking" in ls, timeout=60), (child.lines, log.read_text()[-3000:])
        time.sleep(0.05 + secrets.randbelow(400) / 1000)  # somewhere in the fork
    finally:
        child.kill()
    h.start()
    adopted = set(h.impl.reconciled.get("adopted", []))
    assert ids[0] in adopted, h.impl.reconciled
    assert {r.id for r in h.impl.list()} == adopted and adopted <= set(ids), h.impl.reconciled
    assert h.ok(ids[0], "cat /tmp/mark") == "from-parent\n"
    for sid in adopted - {ids[0]}:  # a child that was adopted is whole
        assert h.ok(sid, "cat /tmp/mark") == "from-parent\n", sid
    for sid in set(ids) - adopted:  # one that was not has no trace left
        assert not h.traces(sid), (sid, h.traces(sid))
    print(f"fork done before the kill: {'FORK-DONE' in child.lines}; children adopted {len(adopted) - 1} of 4")
