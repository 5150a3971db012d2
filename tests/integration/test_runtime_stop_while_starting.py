"""A runtime stopped while it is still starting (the edge's stop, a Ctrl-C during start):
whatever point the start had reached, it leaves nothing behind that no sandbox uses, and
the next start of the same name works. ``close()`` carries on past a failing step and
reports every failure (issue 28)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from conftest import RuntimeHarness

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]

DELAYS_S = (0.0, 0.002, 0.01, 0.03, 0.06, 0.1, 0.2, 0.4, 0.8)


def _cancelled_start(h: RuntimeHarness, delay: float) -> str:
    """Start ``h``'s runtime and cancel the start after ``delay`` s; how far it got. A start
    that ended first is stopped as a cancelled one stops itself (sandboxes it adopted keep running)."""
    async def go() -> str:
        task = asyncio.ensure_future(h.rt.start())
        await asyncio.sleep(delay)
        if task.done():
            await task
            await h.rt.close(destroy_all=not h.rt.sandboxes)
            return "started (then closed)"
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        await h.rt.close(destroy_all=not h.rt.sandboxes)
        return "started (then closed)"
    return h.run(go())


def test_a_start_cancelled_at_any_point_leaves_nothing(make_runtime: Callable[[str], RuntimeHarness]) -> None:
    seen = []
    for i, delay in enumerate(DELAYS_S):
        h = make_runtime(f"halfst{i}")
        h.prepare()
        h.runner = asyncio.Runner()
        try:
            seen.append((delay, _cancelled_start(h, delay)))
            left = h.leftovers()
            assert not left, (delay, left)
        finally:
            h.runner.close()
            h.runner = None
        again = make_runtime(f"halfst{i}").start()  # the name is free again and starts clean
        with again.sandbox() as rec:
            assert again.ok(rec.id, "echo fine") == "fine\n"
        again.close()
        assert not again.leftovers()
    assert any(how == "cancelled" for _, how in seen), seen


def test_a_start_cancelled_during_reconcile_leaves_the_adopted_sandbox_adoptable(
        make_runtime: Callable[[str], RuntimeHarness]) -> None:
    first = make_runtime("halfrc").start()
    rec = first.create()
    first.ok(rec.id, "echo kept > /kept")
    first.close(destroy_all=False)  # the sandbox runs on, as after an edge restart
    for delay in (0.0, 0.01, 0.05, 0.15):
        h = make_runtime("halfrc")
        h.prepare()
        h.runner = asyncio.Runner()
        try:
            _cancelled_start(h, delay)
        finally:
            h.runner.close()
            h.runner = None
    last = make_runtime("halfrc").start()
    try:
        assert rec.id in last.rt.reconciled.get("adopted", []), last.rt.reconciled
        assert last.ok(rec.id, "cat /kept") == "kept\n"
    finally:
        last.close()
    assert not last.leftovers(), last.leftovers()


def test_close_carries_on_past_a_failing_step_and_reports_every_failure(
        make_runtime: Callable[[str], RuntimeHarness], monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec.errors import HostError

    h = make_runtime("closeall").start()
    rec = h.create()
    assert h.ok(rec.id, "echo up") == "up\n"

    async def broken_net_close(*_a: Any, **_k: Any) -> None:
        raise OSError("the network manager would not stop")

    def broken_mounts_close(*_a: Any, **_k: Any) -> None:
        raise OSError("a layer mount is busy")

    monkeypatch.setattr(h.rt.net, "close", broken_net_close)
    real_mounts_close = h.rt.layers.mounts.close
    monkeypatch.setattr(h.rt.layers.mounts, "close", broken_mounts_close)
    with pytest.raises(HostError) as err:
        h.run(h.rt.close())
    msg = str(err.value)
    assert "network manager would not stop" in msg and "layer mount is busy" in msg, msg
    # every other step ran: the sandbox, the spawner, the skeletons and the claims are gone
    assert not h.rt.sandboxes and h.rt.spawner is None
    real_mounts_close()
    h.runner.close()
    h.runner = None
    assert not h.leftovers(), h.leftovers()
