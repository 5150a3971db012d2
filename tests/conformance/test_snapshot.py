"""Snapshots: ``snapshot_info`` packs a sandbox's writable layer into a layer of the edge's store
(``info.layer``: digest, ``name:tag`` ref, lineage); a new sandbox started from that layer sees
the files as they were at the snapshot (written, changed and removed ones), the sandbox goes on
running and its later writes stay its own; excluded paths are left out; a paused sandbox is
snapshotted without waking."""

from __future__ import annotations

import secrets
from typing import Any

import pytest

from dsec.backends.base import Capability
from dsec.errors import SandboxNotFound
from dsec.spec import ImageRef, SandboxState

from .conftest import BackendHarness

pytestmark = [pytest.mark.root, pytest.mark.timeout(120), pytest.mark.requires(Capability.SNAPSHOT)]


def _from(backend: BackendHarness, ref: str) -> Any:
    """A spec like the default one, started from layer ``ref``."""
    return backend.spec().model_copy(update={"image": ImageRef(base=ref)})


def test_a_sandbox_from_a_snapshot_sees_its_files(backend: BackendHarness, sb: Any) -> None:
    word = secrets.token_hex(8)
    backend.ok(sb.id, f"mkdir -p /work/sub && echo {word} > /work/sub/kept && echo changed > /etc/motd"
                      " && printf '\\000\\377bin' > /work/bin && rm /etc/group && chmod 0700 /work/sub")
    info = backend.run(backend.impl.snapshot_info(sb.id, name="cfsnap", tag=word))
    layer = info.layer
    assert layer.ref == f"cfsnap:{word}" and layer.digest.startswith("sha256:") and layer.size > 0, layer
    assert layer.parents, "a snapshot layer names the layers it was packed over"
    assert backend.impl.get(sb.id).state is SandboxState.RUNNING  # the sandbox goes on
    backend.ok(sb.id, "echo after > /work/after && echo later > /work/sub/kept")
    with backend.sandbox(spec=_from(backend, layer.ref)) as child:
        out = backend.ok(child.id, "cat /work/sub/kept /etc/motd; od -An -c /work/bin | tr -s ' ';"
                                   " test -e /etc/group || echo no-group; test -e /work/after || echo no-after;"
                                   " stat -c %a /work/sub")
        assert out.split("\n") == [word, "changed", " \\0 377 b i n", "no-group", "no-after", "700", ""], out
        backend.ok(child.id, "echo child > /work/sub/kept")  # a new sandbox's writes are its own
        assert backend.ok(sb.id, "cat /work/sub/kept") == "later\n"
    # ... and by digest, the same content
    with backend.sandbox(spec=_from(backend, layer.digest)) as again:
        assert backend.ok(again.id, "cat /work/sub/kept") == f"{word}\n"


def test_a_snapshot_on_a_snapshot_keeps_the_lineage(backend: BackendHarness, sb: Any) -> None:
    backend.ok(sb.id, "echo one > /one")
    first = backend.run(backend.impl.snapshot_info(sb.id, name="cfline", tag="1")).layer
    with backend.sandbox(spec=_from(backend, first.ref)) as mid:
        backend.ok(mid.id, "echo two > /two && rm /one")
        second = backend.run(backend.impl.snapshot_info(mid.id, name="cfline", tag="2")).layer
    assert first.digest in second.parents, (first, second)
    with backend.sandbox(spec=_from(backend, second.ref)) as last:
        assert backend.ok(last.id, "cat /two; test -e /one || echo no-one") == "two\nno-one\n"


def test_excluded_paths_are_left_out(backend: BackendHarness, sb: Any) -> None:
    backend.ok(sb.id, "mkdir -p /work/cache /work/src && echo big > /work/cache/blob && echo code > /work/src/main")
    layer = backend.run(backend.impl.snapshot_info(sb.id, name="cfexcl", tag="t", exclude=["/work/cache"])).layer
    with backend.sandbox(spec=_from(backend, layer.ref)) as child:
        assert backend.ok(child.id, "cat /work/src/main; test -e /work/cache/blob || echo no-blob") == \
            "code\nno-blob\n"
    assert backend.ok(sb.id, "cat /work/cache/blob") == "big\n"  # the sandbox's own copy stays


@pytest.mark.requires(Capability.PAUSE)
def test_a_paused_sandbox_is_snapshotted_and_stays_paused(backend: BackendHarness, sb: Any) -> None:
    backend.ok(sb.id, "echo before-pause > /state")
    backend.run(backend.impl.pause(sb.id))
    try:
        layer = backend.run(backend.impl.snapshot_info(sb.id, name="cfpaused", tag="t")).layer
        assert backend.impl.get(sb.id).state is SandboxState.PAUSED
    finally:
        backend.run(backend.impl.resume(sb.id))
    with backend.sandbox(spec=_from(backend, layer.ref)) as child:
        assert backend.ok(child.id, "cat /state") == "before-pause\n"


def test_a_snapshot_of_an_unknown_sandbox_is_not_found(backend: BackendHarness) -> None:
    with pytest.raises(SandboxNotFound):
        backend.run(backend.impl.snapshot_info(f"cf-{secrets.token_hex(5)}", name="cfnone", tag="t"))
