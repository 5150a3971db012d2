"""Bad input gets a typed error (InvalidSpec, ExecError, SandboxNotFound...), never a bare
exception, never a half-done effect: NUL bytes, unknown users, non-positive timeouts and
caps, sandbox ids that do not exist or are malformed."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from dsec.backends.base import Capability
from dsec.errors import DsecError, ExecError, ImageError, InvalidSpec, SandboxNotFound

from .conftest import BackendHarness

pytestmark = [pytest.mark.root, pytest.mark.timeout(90), pytest.mark.requires(Capability.EXEC)]

def _typed(backend: BackendHarness, want: tuple[type[DsecError], ...], make: Callable[[], Coroutine[Any, Any, Any]]
           ) -> DsecError:
    try:
        got = backend.run(make())
    except DsecError as exc:
        assert isinstance(exc, want), f"{exc!r}: wanted one of {[w.__name__ for w in want]}"
        return exc
    raise AssertionError(f"accepted: returned {got!r:.300}")


@pytest.mark.parametrize("argv", [["echo", "a\0b"], ["ec\0ho", "x"], "echo a\0b"], ids=["arg", "argv0", "shell"])
def test_nul_in_argv(backend: BackendHarness, sb: Any, argv: Any) -> None:
    _typed(backend, (InvalidSpec,), lambda: backend.impl.exec(sb.id, argv, timeout=10))


def test_nul_and_equals_in_env_or_cwd(backend: BackendHarness, sb: Any) -> None:
    for env in ({"A": "b\0c"}, {"A\0B": "c"}, {"A=B": "c"}, {"": "x"}):
        _typed(backend, (InvalidSpec,), lambda env=env: backend.impl.exec(sb.id, "true", env=env, timeout=10))
    _typed(backend, (InvalidSpec,), lambda: backend.impl.exec(sb.id, "pwd", cwd="/tm\0p", timeout=10))
    _typed(backend, (InvalidSpec, ExecError), lambda: backend.impl.exec(sb.id, "pwd", cwd="relative", timeout=10))
    _typed(backend, (InvalidSpec,), lambda: backend.impl.exec(sb.id, [], timeout=10))


@pytest.mark.parametrize("user", ["no-such-user-xyz", -1, 1 << 40, "1000:bob"])
def test_unknown_user(backend: BackendHarness, sb: Any, user: Any) -> None:
    _typed(backend, (InvalidSpec, ExecError), lambda: backend.impl.exec(sb.id, "id -u", user=user, timeout=10))


@pytest.mark.parametrize("timeout", [-1, 0, -0.5])
def test_non_positive_timeout(backend: BackendHarness, sb: Any, timeout: float) -> None:
    err = _typed(backend, (InvalidSpec,), lambda: backend.impl.exec(sb.id, "echo ran", timeout=timeout))
    assert err.fields.get("field") == "timeout", err.fields


@pytest.mark.parametrize("idle", [-1, 0])
def test_non_positive_idle_timeout(backend: BackendHarness, sb: Any, idle: float) -> None:
    err = _typed(backend, (InvalidSpec,), lambda: backend.impl.exec(sb.id, "echo ran", idle_timeout=idle, timeout=10))
    assert err.fields.get("field") == "idle_timeout", err.fields


def test_negative_output_cap(backend: BackendHarness, sb: Any) -> None:
    _typed(backend, (InvalidSpec,), lambda: backend.impl.exec(sb.id, "echo hi", output_cap=-5, timeout=10))


def test_sessions_refuse_bad_input_too(backend: BackendHarness, sb: Any) -> None:
    if not backend.kind.declares(Capability.SESSIONS):
        pytest.skip(f"backend {backend.kind.name} does not declare sessions")

    async def go() -> None:
        s = await backend.impl.open_session(sb.id)
        try:
            with pytest.raises(InvalidSpec):
                await s.run("echo a\0b")
            assert (await s.run("echo still")).stdout == b"still\n"
        finally:
            await s.close()

    backend.run(go())
    _typed(backend, (InvalidSpec, ExecError), lambda: backend.impl.open_session(sb.id, user="no-such-user-xyz"))


@pytest.mark.parametrize("sid", ["cf-000000000000", "../x", "", "x" * 300, "a/b"])
def test_a_sandbox_that_does_not_exist(backend: BackendHarness, sid: str) -> None:
    impl = backend.impl
    _typed(backend, (SandboxNotFound,), lambda: impl.exec(sid, "true", timeout=10))
    with pytest.raises(SandboxNotFound):
        impl.get(sid)
    with pytest.raises(SandboxNotFound):
        impl.usage(sid)
    assert backend.run(impl.destroy(sid)) is False
    assert sid not in {r.id for r in impl.list()}
    if backend.kind.declares(Capability.FILES):
        with pytest.raises(SandboxNotFound):
            impl.files(sid)
    if backend.kind.declares(Capability.SESSIONS):
        _typed(backend, (SandboxNotFound,), lambda: impl.open_session(sid))
    if backend.kind.declares(Capability.PAUSE):
        _typed(backend, (SandboxNotFound,), lambda: impl.pause(sid))
        _typed(backend, (SandboxNotFound,), lambda: impl.resume(sid))


@pytest.mark.requires(Capability.SANDBOXES)
def test_bad_creates(backend: BackendHarness) -> None:
    from dsec.spec import ImageRef, SandboxSpec

    impl = backend.impl
    before = {r.id for r in impl.list()}
    for bad in ("../x", "UPPER", "a/b", "-lead", "x" * 200):
        _typed(backend, (InvalidSpec,), lambda bad=bad: impl.create(backend.spec(), sandbox_id=bad))
    missing = SandboxSpec(image=ImageRef(base="no-such-image:test"), backend=backend.kind.name)
    _typed(backend, (ImageError,), lambda: impl.create(missing))
    assert {r.id for r in impl.list()} == before  # nothing half-made is left


@pytest.mark.requires(Capability.SANDBOXES)
def test_a_spec_for_another_backend_is_refused(backend: BackendHarness) -> None:
    from dsec.spec import ImageRef, SandboxSpec

    impl = backend.impl
    before = {r.id for r in impl.list()}
    for other in sorted({"container", "gvisor", "fncall"} - {backend.kind.name}):
        wrong = SandboxSpec(image=ImageRef(base="busybox:test"), backend=other)
        err = _typed(backend, (InvalidSpec,), lambda wrong=wrong: impl.create(wrong))
        assert err.fields.get("field") == "backend", err.fields
    assert {r.id for r in impl.list()} == before
