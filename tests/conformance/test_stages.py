"""Stages: a sandbox declares named stages (file rules, optionally a network policy) and
``set_stage`` switches between them while it runs. File rules bind root inside: a hidden path
cannot be read, listed, written or reached another way; a read-only one can be read, never
changed; the rest stays writable. A switch kills what ran before it (a process from a looser
stage must not keep its access), is recorded (``current_stage``) and an unknown stage is
``InvalidSpec``. The files API obeys the rules of the stage in force too."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from dsec.backends.base import Capability
from dsec.errors import FileAccessError, InvalidSpec, SessionClosed
from dsec.spec import FileRules, ImageRef, SandboxSpec, Stage

from .conftest import IMAGE, BackendHarness, add_layer, wait_until

pytestmark = [pytest.mark.root, pytest.mark.timeout(120), pytest.mark.requires(Capability.STAGES)]

SECRET = "answer-" + secrets.token_hex(6)
N = 10_000 + secrets.randbelow(80_000)

STAGES = {
    "setup": Stage(),  # no rules
    "rollout": Stage(files=FileRules(hidden=("/tests",), read_only=("/etc",))),
    "evaluate": Stage(files=FileRules(read_only=("/workspace", "/tests"))),
    "locked": Stage(files=FileRules(default="ro", writable=("/tmp",))),
}


@pytest.fixture(scope="module")
def staged(backend: BackendHarness, tmp_path_factory: pytest.TempPathFactory) -> SandboxSpec:
    """The spec of a sandbox over busybox + a workspace layer with /tests (the answer key) and
    /workspace (the agent's), starting in ``setup``."""
    ref = add_layer(backend, {"tests/expected": SECRET + "\n", "workspace/answer": "wrong\n",
                              "tests/run.sh": '#!/bin/sh\n[ "$(cat /workspace/answer)" = "$(cat /tests/expected)" ]'
                                              ' && echo PASS || echo FAIL\n'},
                    name="cfstagews", tmp=tmp_path_factory.mktemp("cf-stages"))
    return backend.spec().model_copy(update={"image": ImageRef(base=IMAGE, workspace=ref), "stages": STAGES,
                                             "stage": "setup"})


@pytest.fixture
def ssb(backend: BackendHarness, staged: SandboxSpec) -> Iterator[Any]:
    with backend.sandbox(spec=staged) as rec:
        yield rec


def _refused(backend: BackendHarness, sid: str, cmd: str, user: int = 0) -> None:
    r = backend.sh(sid, cmd, user=user)
    assert r.exit_code != 0, f"{cmd!r} (uid {user}) was allowed: stdout={r.stdout!r}"
    assert SECRET.encode() not in r.stdout + r.stderr, cmd


def _switch(backend: BackendHarness, sid: str, name: str) -> None:
    rec = backend.run(backend.impl.set_stage(sid, name))
    assert rec.current_stage == name and backend.impl.get(sid).current_stage == name


def test_a_sandbox_starts_in_its_spec_stage(backend: BackendHarness, ssb: Any) -> None:
    assert backend.impl.get(ssb.id).current_stage == "setup"
    assert backend.ok(ssb.id, "cat /tests/expected") == SECRET + "\n"  # setup: no rules
    backend.ok(ssb.id, "echo setup-wrote > /etc/setup && echo more >> /tests/expected")


def test_hidden_paths_bind_root(backend: BackendHarness, ssb: Any) -> None:
    backend.ok(ssb.id, "ln -s /tests/expected /workspace/sym")  # planted while still allowed
    _switch(backend, ssb.id, "rollout")
    # (Names in a hidden directory may still be listed: FileRules.hidden says so.)
    for cmd in ("cat /tests/expected", "cd /tests && cat expected", "cat /proc/self/root/tests/expected",
                "cat /workspace/sym", "cp -r /tests /tmp/copy && cat /tmp/copy/expected", "/tests/run.sh",
                "echo pwned > /tests/expected", "rm -rf /tests", "mv /tests /tmp/moved"):
        _refused(backend, ssb.id, cmd)
        _refused(backend, ssb.id, cmd, user=1000)
    _switch(backend, ssb.id, "setup")  # the files themselves were never touched
    assert backend.ok(ssb.id, "cat /tests/expected; ls /tests") == f"{SECRET}\nexpected\nrun.sh\n"


def test_read_only_paths_are_read_never_changed(backend: BackendHarness, ssb: Any) -> None:
    _switch(backend, ssb.id, "rollout")
    before = backend.ok(ssb.id, "cat /etc/passwd")
    for cmd in ("echo x >> /etc/passwd", "rm /etc/passwd", "mv /etc/passwd /tmp/p", "touch /etc/new",
                "mkdir /etc/d", "ln -s /x /etc/link", "chmod 777 /etc/passwd && echo x >> /etc/passwd"):
        _refused(backend, ssb.id, cmd)
    assert backend.ok(ssb.id, "cat /etc/passwd") == before
    backend.ok(ssb.id, "echo fixed > /workspace/answer && echo t > /tmp/t")  # the rest stays writable
    _switch(backend, ssb.id, "evaluate")
    assert backend.ok(ssb.id, "/tests/run.sh") == "FAIL\n"
    _refused(backend, ssb.id, "echo wrong > /workspace/answer")
    _refused(backend, ssb.id, f"echo {SECRET}-x > /tests/expected")
    assert backend.ok(ssb.id, "cat /workspace/answer") == "fixed\n"


def test_default_read_only_with_writable_exceptions(backend: BackendHarness, ssb: Any) -> None:
    _switch(backend, ssb.id, "locked")
    backend.ok(ssb.id, "echo ok > /tmp/ok && cat /tmp/ok")
    for cmd in ("echo x > /workspace/answer", "touch /new", "mkdir /srv/x", "echo x > /etc/x"):
        _refused(backend, ssb.id, cmd)
    assert backend.ok(ssb.id, "cat /workspace/answer") == "wrong\n"


def test_a_switch_kills_what_ran_before(backend: BackendHarness, ssb: Any) -> None:
    # An open file descriptor on the key, held by a process from the looser stage, must not
    # survive into the stricter one.
    backend.ok(ssb.id, f"exec 3</tests/expected; setsid sleep 3{N} <&3 >/dev/null 2>&1 &")
    assert backend.sandbox_processes(ssb.id, f"3{N}")
    _switch(backend, ssb.id, "rollout")
    assert wait_until(lambda: not backend.sandbox_processes(ssb.id, f"3{N}"), timeout=5), \
        backend.sandbox_processes(ssb.id, f"3{N}")
    assert backend.ok(ssb.id, "echo after-switch") == "after-switch\n"


@pytest.mark.requires(Capability.SESSIONS)
def test_a_switch_ends_open_sessions(backend: BackendHarness, ssb: Any) -> None:
    async def go() -> None:
        s = await backend.impl.open_session(ssb.id)
        try:
            assert (await s.run("cat /tests/expected")).stdout == f"{SECRET}\n".encode()
            await backend.impl.set_stage(ssb.id, "rollout")
            with pytest.raises(SessionClosed):
                await s.run("cat /tests/expected")
        finally:
            await s.close()
        fresh = await backend.impl.open_session(ssb.id)  # a new one starts under the new rules
        try:
            r = await fresh.run("cat /tests/expected")
            assert r.exit_code != 0 and SECRET.encode() not in r.stdout, r
        finally:
            await fresh.close()

    backend.run(go())


def test_an_unknown_stage_is_invalid_and_changes_nothing(backend: BackendHarness, ssb: Any) -> None:
    with pytest.raises(InvalidSpec):
        backend.run(backend.impl.set_stage(ssb.id, "no-such-stage"))
    assert backend.impl.get(ssb.id).current_stage == "setup"
    assert backend.ok(ssb.id, "cat /tests/expected") == SECRET + "\n"


@pytest.mark.requires(Capability.FILES)
def test_the_files_api_obeys_the_stage(backend: BackendHarness, ssb: Any) -> None:
    f = backend.impl.files(ssb.id)
    assert f.read("/tests/expected") == f"{SECRET}\n".encode()
    _switch(backend, ssb.id, "rollout")
    with pytest.raises(FileAccessError):
        f = backend.impl.files(ssb.id)
        f.read("/tests/expected")
    f = backend.impl.files(ssb.id)
    for attempt in (lambda: f.write("/tests/expected", b"x"), lambda: f.list("/tests"),
                    lambda: f.write("/etc/passwd", b"x")):
        with pytest.raises(FileAccessError):
            attempt()
    assert b"root" in f.read("/etc/passwd")  # read-only: readable
    f.write("/workspace/answer", b"via-files\n")
    assert backend.ok(ssb.id, "cat /workspace/answer") == "via-files\n"

