"""Pristine paths: ``exec(..., pristine=[paths])`` runs that one command with those paths as the
image shipped them (read-only copies from the image layers), whatever the sandbox did to them,
so an agent that edited the test runner or deleted the answer key cannot change the verdict.
Only that command sees the copies; the sandbox's own files are left as they are. A sandbox from
a snapshot gets the image's copies, not the snapshot's. Bad paths are typed errors."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from dsec.backends.base import Capability
from dsec.errors import ExecError, InvalidSpec
from dsec.spec import FileRules, ImageRef, SandboxSpec, Stage

from .conftest import IMAGE, BackendHarness, add_layer

pytestmark = [pytest.mark.root, pytest.mark.timeout(120), pytest.mark.requires(Capability.PRISTINE)]

SECRET = "key-" + secrets.token_hex(6)
RUN = '#!/bin/sh\n[ "$(cat /workspace/answer)" = "$(cat /tests/expected)" ] && echo PASS || echo FAIL\n'


@pytest.fixture(scope="module")
def image(backend: BackendHarness, tmp_path_factory: pytest.TempPathFactory) -> ImageRef:
    ref = add_layer(backend, {"tests/expected": SECRET + "\n", "tests/run.sh": RUN, "tests/data/x": "x\n",
                              "workspace/answer": "wrong\n"},
                    name="cfpristine", tmp=tmp_path_factory.mktemp("cf-pristine"))
    return ImageRef(base=IMAGE, workspace=ref)


@pytest.fixture
def psb(backend: BackendHarness, image: ImageRef) -> Iterator[Any]:
    with backend.sandbox(spec=backend.spec().model_copy(update={"image": image})) as rec:
        yield rec


def _tamper(backend: BackendHarness, sid: str) -> None:
    """What a cheating agent does: the runner always passes, the key is gone, a file is added."""
    backend.ok(sid, "printf '#!/bin/sh\\necho PASS\\n' > /tests/run.sh && rm /tests/expected"
                    " && echo planted > /tests/data/extra && echo hacked > /etc/motd")


def test_a_pristine_command_sees_the_image_not_the_tampering(backend: BackendHarness, psb: Any) -> None:
    _tamper(backend, psb.id)
    assert backend.ok(psb.id, "/tests/run.sh") == "PASS\n"  # what the agent made
    r = backend.sh(psb.id, "/tests/run.sh; cat /tests/expected; ls /tests/data", pristine=["/tests"])
    assert (r.exit_code, r.stdout.decode()) == (0, f"FAIL\n{SECRET}\nx\n"), r
    backend.ok(psb.id, f"echo {SECRET} > /workspace/answer")  # a right answer passes the real runner
    assert backend.ok(psb.id, "/tests/run.sh", pristine=["/tests"]) == "PASS\n"
    # Only that command: the sandbox's files are still what it made.
    assert backend.ok(psb.id, "cat /tests/run.sh; ls /tests/data; test -e /tests/expected || echo no-key") == \
        "#!/bin/sh\necho PASS\nextra\nx\nno-key\n"


def test_pristine_copies_are_read_only(backend: BackendHarness, psb: Any) -> None:
    for cmd in ("echo x > /tests/expected", "rm /tests/run.sh", "touch /tests/new", "umount /tests"):
        r = backend.sh(psb.id, f"{cmd} && echo DONE", pristine=["/tests"])
        assert b"DONE" not in r.stdout, (cmd, r)
    assert backend.ok(psb.id, "cat /tests/expected", pristine=["/tests"]) == SECRET + "\n"
    assert backend.ok(psb.id, "cat /tests/expected") == SECRET + "\n"


def test_several_paths_and_a_file_of_the_base_layer(backend: BackendHarness, psb: Any) -> None:
    _tamper(backend, psb.id)
    out = backend.ok(psb.id, "cat /tests/expected; cat /etc/motd 2>/dev/null | grep -c hacked || true",
                     pristine=["/tests", "/etc"])
    assert out == f"{SECRET}\n0\n", out
    assert backend.ok(psb.id, "cat /etc/motd") == "hacked\n"


@pytest.mark.requires(Capability.SNAPSHOT)
def test_a_sandbox_from_a_snapshot_gets_the_images_copies(backend: BackendHarness, psb: Any, image: ImageRef) -> None:
    _tamper(backend, psb.id)
    layer = backend.run(backend.impl.snapshot_info(psb.id, name="cfprsnap", tag="t")).layer
    spec = backend.spec().model_copy(update={"image": ImageRef(base=layer.ref)})
    with backend.sandbox(spec=spec) as child:
        assert backend.ok(child.id, "/tests/run.sh") == "PASS\n"  # the snapshot holds the tampering
        assert backend.ok(child.id, "/tests/run.sh; cat /tests/expected", pristine=["/tests"]) == f"FAIL\n{SECRET}\n"


@pytest.mark.requires(Capability.STAGES)
def test_a_hidden_path_stays_hidden_under_pristine(backend: BackendHarness, image: ImageRef) -> None:
    spec = SandboxSpec(image=image, backend=backend.kind.name, stage="setup",
                       stages={"setup": Stage(), "rollout": Stage(files=FileRules(hidden=("/tests",)))})
    with backend.sandbox(spec=spec) as rec:
        backend.run(backend.impl.set_stage(rec.id, "rollout"))
        r = backend.sh(rec.id, "cat /tests/expected", pristine=["/tests"])
        assert r.exit_code != 0 and SECRET.encode() not in r.stdout, r


def test_bad_paths_are_typed_errors(backend: BackendHarness, psb: Any) -> None:
    with pytest.raises(ExecError):
        backend.sh(psb.id, "true", pristine=["/not-in-the-image"])
    for bad in ("tests", "/tests/../etc", "/"):
        with pytest.raises(InvalidSpec):
            backend.sh(psb.id, "true", pristine=[bad])
    backend.ok(psb.id, "rm -rf /tests")
    with pytest.raises(ExecError):  # removed up to the root: no intact directory of the image to stand in
        backend.sh(psb.id, "ls /tests", pristine=["/tests"])
