"""Fork: ``fork(sandbox_id, n | ids)`` makes sandboxes whose disks equal the parent's at that
instant; from then on parent and children are independent (no one sees another's writes);
each child is a sandbox of its own (distinct id, running, destroyed alone); ids and edge parts
given are kept; a paused parent stays paused; children start in the stage in force."""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from dsec.backends.base import Capability, EdgeMeta
from dsec.errors import DsecError, InvalidSpec, SandboxNotFound
from dsec.spec import FileRules, SandboxState, Stage

from .conftest import BackendHarness, wait_until

pytestmark = [pytest.mark.root, pytest.mark.timeout(120), pytest.mark.requires(Capability.FORK)]


@contextmanager
def forked(backend: BackendHarness, sid: str, children: int | Sequence[str], **kw: Any) -> Iterator[list[Any]]:
    """``fork`` the sandbox; the children are destroyed afterwards (and scanned for traces)."""
    made = list(backend.run(backend.impl.fork(sid, children, **kw)))
    for c in made:
        backend.track(c.id)
    try:
        yield made
    finally:
        for c in made:
            backend.run(backend.impl.destroy(c.id))


def test_children_start_from_the_parents_disk_and_are_independent_after(backend: BackendHarness, sb: Any) -> None:
    word = secrets.token_hex(8)
    backend.ok(sb.id, f"mkdir /work && echo {word} > /work/f && echo gone > /work/rm && rm /work/rm")
    with forked(backend, sb.id, 3) as kids:
        ids = [c.id for c in kids]
        assert len(set(ids)) == 3 and sb.id not in ids, ids
        backend.ok(sb.id, "echo parent-later > /work/later && echo parent > /work/f")
        for c in kids:
            assert backend.impl.get(c.id).state is SandboxState.RUNNING
            assert c.id in {r.id for r in backend.impl.list()}
            assert backend.ok(c.id, "cat /work/f; ls /work") == f"{word}\nf\n"  # the parent's disk then
        backend.ok(ids[0], "echo mine > /work/f && echo own > /work/own")
        assert backend.ok(ids[1], "cat /work/f; ls /work") == f"{word}\nf\n"  # a sibling's writes stay its own
        assert backend.ok(sb.id, "cat /work/f; ls /work") == "parent\nf\nlater\n"  # and the parent's
        # Each child is a sandbox on its own: destroying one leaves the rest (and the parent) running.
        assert backend.run(backend.impl.destroy(ids[2])) is True
        assert wait_until(lambda: not backend.traces(ids[2]), timeout=5), backend.traces(ids[2])
        assert backend.ok(ids[1], "echo alive") == "alive\n"
        assert backend.ok(sb.id, "echo alive") == "alive\n"
        assert backend.run(backend.impl.destroy(ids[2])) is False


def test_given_ids_and_edge_parts_are_kept(backend: BackendHarness, sb: Any) -> None:
    ids = [f"cf-{secrets.token_hex(5)}" for _ in range(2)]
    edges = [EdgeMeta(labels={"child": str(i)}, task="t-fork") for i in range(2)]
    with forked(backend, sb.id, ids, edges=edges) as kids:
        assert [c.id for c in kids] == ids
        for i, sid in enumerate(ids):
            rec = backend.impl.get(sid)
            assert rec.edge.labels == {"child": str(i)} and rec.edge.task == "t-fork", rec.edge
            assert backend.ok(sid, "echo child") == "child\n"


def test_excluded_paths_are_not_given_to_the_children(backend: BackendHarness, sb: Any) -> None:
    backend.ok(sb.id, "mkdir -p /work/secret && echo key > /work/secret/k && echo code > /work/main")
    with forked(backend, sb.id, 1, exclude=["/work/secret"]) as (kid,):
        assert backend.ok(kid.id, "cat /work/main; test -e /work/secret/k || echo no-key") == "code\nno-key\n"
    assert backend.ok(sb.id, "cat /work/secret/k") == "key\n"


def test_a_fork_that_cannot_be_made_makes_nothing(backend: BackendHarness, sb: Any) -> None:
    before = {r.id for r in backend.impl.list()}
    with pytest.raises(SandboxNotFound):
        backend.run(backend.impl.fork(f"cf-{secrets.token_hex(5)}", 1))
    with pytest.raises(InvalidSpec):
        backend.run(backend.impl.fork(sb.id, 0))
    with pytest.raises(InvalidSpec):
        backend.run(backend.impl.fork(sb.id, [f"cf-{secrets.token_hex(5)}"], edges=[]))  # one edge part a child
    assert {r.id for r in backend.impl.list()} == before, "a refused fork left sandboxes"
    assert backend.ok(sb.id, "echo parent-fine") == "parent-fine\n"


def test_a_child_id_that_names_a_live_sandbox_is_refused(backend: BackendHarness, sb: Any) -> None:
    # A fork's children are new sandboxes: an id already in use (here the parent's own) cannot
    # be one. Handing back the sandbox that holds it as a "child" would let the caller destroy
    # the parent, or another tenant's sandbox, believing it a fresh copy.
    before = {r.id for r in backend.impl.list()}
    fresh = f"cf-{secrets.token_hex(5)}"
    with pytest.raises(DsecError):
        made = backend.run(backend.impl.fork(sb.id, [fresh, sb.id]))
        for c in made:  # reached only when the fork wrongly succeeded: leave nothing behind
            if c.id != sb.id:
                backend.track(c.id)
                backend.run(backend.impl.destroy(c.id))
    assert {r.id for r in backend.impl.list()} == before, "a refused fork left sandboxes"
    assert not backend.traces(fresh), backend.traces(fresh)
    assert backend.ok(sb.id, "echo parent-fine") == "parent-fine\n"


@pytest.mark.requires(Capability.PAUSE)
def test_a_paused_parent_is_forked_and_stays_paused(backend: BackendHarness, sb: Any) -> None:
    backend.ok(sb.id, "echo frozen-state > /state")
    backend.run(backend.impl.pause(sb.id))
    try:
        with forked(backend, sb.id, 1) as (kid,):
            assert backend.impl.get(sb.id).state is SandboxState.PAUSED
            assert backend.impl.get(kid.id).state is SandboxState.RUNNING
            assert backend.ok(kid.id, "cat /state") == "frozen-state\n"
    finally:
        backend.run(backend.impl.resume(sb.id))
    assert backend.ok(sb.id, "cat /state") == "frozen-state\n"


@pytest.mark.requires(Capability.STAGES)
def test_children_start_in_the_stage_in_force(backend: BackendHarness) -> None:
    stages = {"open": Stage(), "closed": Stage(files=FileRules(hidden=("/answers",)))}
    spec = backend.spec().model_copy(update={"stages": stages, "stage": "open"})
    with backend.sandbox(spec=spec) as parent:
        backend.ok(parent.id, "mkdir /answers && echo 42 > /answers/key")
        backend.run(backend.impl.set_stage(parent.id, "closed"))
        with forked(backend, parent.id, 1) as (kid,):
            assert backend.impl.get(kid.id).current_stage == "closed"
            r = backend.sh(kid.id, "cat /answers/key")
            assert r.exit_code != 0 and b"42" not in r.stdout, r
