"""The twin of every ``requires`` mark: an operation a backend does not declare is refused
with ``Unsupported`` naming the operation and the backend (HTTP 400 at the edge), never another
error and never a half-done effect; and every sandbox backend declares :data:`REQUIRED`."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dsec.backends.base import Backend, Capability, TtySize
from dsec.errors import DsecError, Unsupported
from dsec.spec import ImageRef, NetworkPolicy, SandboxSpec, Stage

from .conftest import REQUIRED, BackendHarness, Kind

pytestmark = [pytest.mark.root, pytest.mark.timeout(60)]


def _spec(kind: str, **kw: Any) -> SandboxSpec:
    return SandboxSpec(image=ImageRef(base="busybox:test"), backend=kind, **kw)


# One call per capability, made on a live sandbox (or, without SANDBOXES, on any id: the
# refusal comes from the capabilities, before the id is looked up). FNCALL has no
# operation in the sandbox protocol, so nothing to call here.
CALLS: dict[Capability, Callable[[Any, str, str], Any]] = {
    Capability.SANDBOXES: lambda b, sid, kind: b.create(_spec(kind)),
    Capability.EXEC: lambda b, sid, kind: b.exec(sid, "true", timeout=10),
    Capability.SESSIONS: lambda b, sid, kind: b.open_session(sid),
    Capability.PTY: lambda b, sid, kind: b.start_tty(sid, ["sh"], size=TtySize()),
    Capability.FILES: lambda b, sid, kind: b.files(sid),
    Capability.PAUSE: lambda b, sid, kind: b.pause(sid),
    Capability.SNAPSHOT: lambda b, sid, kind: b.snapshot_info(sid),
    Capability.FORK: lambda b, sid, kind: b.fork(sid, 1),
    Capability.NETWORK: lambda b, sid, kind: b.set_policy(sid, NetworkPolicy(allow=("pkgs",))),
    Capability.STAGES: lambda b, sid, kind: b.set_stage(sid, "next"),
    Capability.PRISTINE: lambda b, sid, kind: b.exec(sid, "true", pristine=["/etc"], timeout=10),
}
# Creates that need a capability: refused by the create itself.
CREATES: dict[Capability, Callable[[str], SandboxSpec]] = {
    Capability.NETWORK: lambda kind: _spec(kind, network=NetworkPolicy(allow=("pkgs",))),
    Capability.STAGES: lambda kind: _spec(kind, stages={"a": Stage()}, stage="a"),
}


def test_every_sandbox_backend_declares_the_required_capabilities(backend_kind: Kind) -> None:
    missing = REQUIRED - backend_kind.capabilities.ops
    assert not missing, f"backend {backend_kind.name} lacks required {sorted(c.value for c in missing)}"
    assert backend_kind.capabilities.kind == backend_kind.name
    assert backend_kind.capabilities.isolation, "say what stands between a sandbox and the host"


def test_the_backend_satisfies_the_protocol(backend: BackendHarness) -> None:
    assert isinstance(backend.impl, Backend)
    assert backend.impl.capabilities == backend.kind.capabilities
    assert isinstance(backend.impl.reconciled, dict)


@pytest.fixture(scope="module")
def target(backend: BackendHarness) -> Iterator[str]:
    """A live sandbox when the backend makes them, else a made-up id."""
    if not backend.kind.declares(Capability.SANDBOXES):
        yield "cf-000000000000"
        return
    with backend.sandbox() as rec:
        yield rec.id


@pytest.mark.parametrize("cap", list(CALLS), ids=lambda c: c.value)
def test_an_undeclared_capability_is_unsupported(request: pytest.FixtureRequest, backend: BackendHarness,
                                                 cap: Capability) -> None:
    if backend.kind.declares(cap):
        pytest.skip(f"backend {backend.kind.name} declares {cap.value}: its cases run instead")
    target: str = request.getfixturevalue("target")
    impl, kind = backend.impl, backend.kind.name
    before = {r.id for r in impl.list()} if backend.kind.declares(Capability.SANDBOXES) else set()
    calls = [lambda: CALLS[cap](impl, target, kind)]
    if cap in CREATES:
        calls.append(lambda: impl.create(CREATES[cap](kind)))
    for call in calls:
        with pytest.raises(DsecError) as ei:
            out = call()
            if inspect.isawaitable(out):
                backend.run(out)
        err = ei.value
        assert type(err) is Unsupported, f"{cap.value}: {err!r} (wanted Unsupported)"
        assert err.backend == kind and err.http_status == 400, err.fields
    if backend.kind.declares(Capability.SANDBOXES):
        assert {r.id for r in impl.list()} == before  # nothing made on the way
    if backend.kind.declares(Capability.EXEC) and backend.kind.declares(Capability.SANDBOXES):
        assert backend.ok(target, "echo fine") == "fine\n"
