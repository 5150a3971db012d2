"""fork(n): n sandboxes whose disks equal the parent's at that instant.

Children get their own identity (hostname = id, a fresh /etc/machine-id), see
nothing of each other's or the parent's later writes, can be made from a
paused parent (which stays paused), never from a failed one, and the unnamed
snapshot behind them goes away once none of them is left.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from conftest import RuntimeHarness, pid_alive, wait_until
from dsec.backends.container import snapshot as snapshots
from dsec.errors import InvalidSpec, LayerNotFound, SandboxFailed, SandboxStateError
from dsec.spec import SandboxState

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def frt(make_runtime: Callable[[str], RuntimeHarness]) -> Iterator[RuntimeHarness]:
    h = make_runtime("fork").start()
    try:
        yield h
    finally:
        h.close()
    assert not h.leftovers(), h.leftovers()
    assert not [lay for lay in h.rt.store.list() if lay.name == snapshots.FORK_NAME]


def _fork_layers(h: RuntimeHarness) -> list[str]:
    return [lay.digest for lay in h.rt.store.list() if lay.name == snapshots.FORK_NAME]


def _forget(h: RuntimeHarness, children: list[Any]) -> None:
    for c in children:
        h.destroy(c.id)


def test_fork_gives_equal_disks_fresh_identities_and_isolation(frt: RuntimeHarness) -> None:
    h = frt
    with h.sandbox() as parent:
        h.ok(parent.id, "echo 0123456789abcdef0123456789abcdef > /etc/machine-id; mkdir /work; echo base > /work/f;"
                        " echo gone > /work/rm; rm /work/rm; rm /etc/group")
        children = h.run(h.rt.fork(parent.id, 4))
        try:
            assert len(children) == 4 and len({c.id for c in children}) == 4
            h.ok(parent.id, "echo later > /work/later")
            layer = h.rt.store.get(children[0].layers[0])
            assert layer.name == snapshots.FORK_NAME and list(layer.parents) == h.rt.get(parent.id).layers
            ids = set()
            for c in children:
                assert h.rt.get(c.id).state is SandboxState.RUNNING
                assert h.rt.get(c.id).layers == [layer.digest, *layer.parents]
                out = h.ok(c.id, "hostname; cat /work/f; ls /work; test -e /etc/group || echo nogroup")
                assert out == f"{c.id}\nbase\nf\nnogroup\n", out
                mid = h.ok(c.id, "cat /etc/machine-id").strip()
                assert len(mid) == 32 and mid != "0123456789abcdef0123456789abcdef"
                ids.add(mid)
            assert len(ids) == 4
            # Siblings (and the parent) never see each other's writes.
            h.ok(children[0].id, "echo mine > /work/f; echo new > /work/own")
            assert h.ok(children[1].id, "cat /work/f; ls /work") == "base\nf\n"
            assert h.ok(parent.id, "cat /work/f") == "base\n"
            events = [e["event"] for e in h.rt.events(children[0].id)]
            assert "forked" in events
        finally:
            _forget(h, children)
        h.rt.layers.maybe_release(layer.digest)  # skip the 1 s grace
        assert layer.digest not in _fork_layers(h)
        with pytest.raises(LayerNotFound):
            h.rt.store.get(layer.digest)


def test_fork_of_a_paused_sandbox(frt: RuntimeHarness) -> None:
    h = frt
    with h.sandbox() as parent:
        h.ok(parent.id, "echo before-pause > /state")
        h.run(h.rt.pause(parent.id))
        children = h.run(h.rt.fork(parent.id, 2))
        try:
            assert h.rt.get(parent.id).state is SandboxState.PAUSED
            for c in children:
                assert h.ok(c.id, "cat /state") == "before-pause\n"
        finally:
            _forget(h, children)


def test_fork_refusals_leave_nothing(frt: RuntimeHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    h = frt
    before_layers, before_sbs = set(_fork_layers(h)), set(h.rt.sandboxes)
    with h.sandbox() as rec:
        with pytest.raises(InvalidSpec):
            h.run(h.rt.fork(rec.id, 0))
        # One child fails: the others are destroyed, the snapshot removed, the error raised.
        real_create = h.rt.create
        calls = {"n": 0}

        async def flaky_create(spec: Any, **kw: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 2:
                raise SandboxFailed("injected", sandbox_id="x", reason="test")
            return await real_create(spec, **kw)

        monkeypatch.setattr(h.rt, "create", flaky_create)
        with pytest.raises(SandboxFailed, match="injected"):
            h.run(h.rt.fork(rec.id, 3))
        monkeypatch.undo()
        assert set(h.rt.sandboxes) == before_sbs | {rec.id}
        assert set(_fork_layers(h)) == before_layers
        # A failed sandbox cannot be forked.
        h.ok(rec.id, "true")
        import os

        os.kill(rec.init_pid, 9)
        assert wait_until(lambda: not pid_alive(rec.init_pid))
        with pytest.raises(SandboxFailed):
            h.ok(rec.id, "true")  # the runtime notices and marks it failed
        assert h.rt.get(rec.id).state is SandboxState.FAILED
        with pytest.raises(SandboxStateError) as ei:
            h.run(h.rt.fork(rec.id, 2))
        assert ei.value.fields["state"] == "failed"
    assert set(h.rt.sandboxes) == before_sbs
    assert set(_fork_layers(h)) == before_layers
