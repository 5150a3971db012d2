"""Stages (Landlock file rules that bind root inside) and pristine paths, on the real kernel.

Each test plays the agent: root inside the sandbox, trying to read what a stage
hides or change what it makes read-only, by every route it can think of. An
attack that gets through is a bug in the runtime, not a case to drop.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import RuntimeHarness, mountinfo_lines
from dsec.errors import ExecError, InvalidSpec, SessionClosed
from dsec.spec import FileRules, ImageRef, Resources, SandboxSpec, Stage

pytestmark = pytest.mark.root

SECRET = "expected-answer-42"

STAGES = {
    "setup": Stage(),  # everything writable: no Landlock at all
    "rollout": Stage(files=FileRules(hidden=("/tests",), read_only=("/bin", "/etc"))),
    "evaluate": Stage(files=FileRules(read_only=("/workspace", "/tests"))),
    "locked": Stage(files=FileRules(default="ro", writable=("/workspace", "/tmp"))),
    "nested": Stage(files=FileRules(default="ro", writable=("/workspace",), hidden=("/workspace/private",),
                                    read_only=("/workspace/private/open",))),
}


@pytest.fixture(scope="module")
def h(make_runtime: Callable[[str], RuntimeHarness], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeHarness]:
    from dsec.images import build_from_dir

    harness = make_runtime("stages").start()
    ws = tmp_path_factory.mktemp("stages-ws")
    (ws / "tests").mkdir()
    (ws / "tests" / "expected").write_text(SECRET + "\n")
    run = ws / "tests" / "run.sh"
    run.write_text('#!/bin/sh\nif [ "$(cat /workspace/answer)" = "$(cat /tests/expected)" ]; then echo PASS; else echo FAIL; fi\n')
    run.chmod(0o755)
    (ws / "workspace").mkdir()
    (ws / "workspace" / "answer").write_text("wrong\n")
    (ws / "workspace" / "private").mkdir()
    (ws / "workspace" / "private" / "key").write_text("private-key\n")
    (ws / "workspace" / "private" / "open").mkdir()
    (ws / "workspace" / "private" / "open" / "notes").write_text("notes\n")
    harness.ws = build_from_dir(harness.rt.store, ws, name="stagews", tag="test", kind="workspace")  # type: ignore[attr-defined]
    try:
        yield harness
    finally:
        harness.close()
    assert harness.leftovers() == []


def _spec(stage: str | None = "setup", **extra: Any) -> SandboxSpec:
    return SandboxSpec(image=ImageRef(base="busybox:test", workspace="stagews:test"),
                       resources=Resources(memory=128 << 20), stages=STAGES, stage=stage, **extra)


@pytest.fixture
def sb(h: RuntimeHarness) -> Iterator[Any]:
    rec = h.run(h.rt.create(_spec()))
    try:
        yield rec
    finally:
        h.destroy(rec.id)


def _stage(h: RuntimeHarness, sid: str, name: str) -> Any:
    return h.run(h.rt.set_stage(sid, name))


def _fails(h: RuntimeHarness, sid: str, cmd: str, **kw: Any) -> str:
    r = h.sh(sid, cmd, **kw)
    assert r.exit_code != 0, f"{cmd!r} succeeded but must be refused: stdout={r.stdout!r}"
    assert SECRET.encode() not in r.stdout, cmd
    return str(r.stderr.decode())


# ------------------------------------------------------------------ hidden ----


def test_landlock_abi_reported(h: RuntimeHarness) -> None:
    assert h.rt.landlock_abi >= 1


def test_hidden_path_unreadable_even_by_root(h: RuntimeHarness, sb: Any) -> None:
    assert SECRET in h.ok(sb.id, "cat /tests/expected")  # setup: readable
    _stage(h, sb.id, "rollout")
    for cmd in (
        "cat /tests/expected",
        "cd /tests && cat expected",
        "cat /proc/self/root/tests/expected",
        "cat /proc/1/root/tests/expected",
        "cd /proc/self/root/tests && cat ./expected",
        "exec 3</tests/expected && cat <&3",
        "cp -r /tests /tmp/copy && cat /tmp/copy/expected",
        "echo pwned > /tests/expected",
        "echo pwned >> /tests/new",
        "mv /tests/expected /workspace/stolen",
        "mv /tests /workspace/stolen",
        "ln /tests/expected /workspace/hard && cat /workspace/hard",
        "rm -f /tests/expected",
        "rm -rf /tests",
        f"tar cf - /tests 2>/dev/null | tar xOf - | grep {SECRET}",
        "/tests/run.sh",
    ):
        _fails(h, sb.id, cmd)
    # Through a symlink the agent plants now: the target's rules apply.
    h.ok(sb.id, "ln -s /tests/expected /workspace/sym && ln -s /tests /tmp/dirsym")
    _fails(h, sb.id, "cat /workspace/sym")
    _fails(h, sb.id, "cat /tmp/dirsym/expected")
    # The same as an unprivileged user.
    r = h.sh(sb.id, "cat /tests/expected", user=1000)
    assert r.exit_code != 0 and SECRET.encode() not in r.stdout
    # Documented: names in a hidden directory can still be listed (READ_DIR on "/").
    assert "expected" in h.ok(sb.id, "ls /tests")
    assert h.rt.files(sb.id, platform=True).read("/tests/expected") == (SECRET + "\n").encode()  # the platform still can


def test_hidden_path_through_a_symlink_planted_before_the_switch(h: RuntimeHarness, sb: Any) -> None:
    h.ok(sb.id, "ln -s /tests/expected /workspace/early; ln -s ../tests /workspace/rel")
    _stage(h, sb.id, "rollout")
    _fails(h, sb.id, "cat /workspace/early")
    _fails(h, sb.id, "cat /workspace/rel/expected")


def test_hard_link_made_before_the_switch_is_broken(h: RuntimeHarness, sb: Any) -> None:
    # In an open stage the agent links a hidden-to-be file and a read-only-to-be file.
    h.ok(sb.id, "ln /tests/expected /workspace/hl && ln /tests/run.sh /workspace/runner")
    assert h.ok(sb.id, "stat -c %h /tests/expected /workspace/hl").split() == ["2", "2"]  # one inode
    _stage(h, sb.id, "rollout")
    ev = [e for e in h.rt.events(sb.id) if e["event"] == "stage_changed"][-1]
    assert "/tests/expected" in ev["links_split"] and "/tests/run.sh" in ev["links_split"]
    # Writing through the other name no longer reaches the test runner...
    h.ok(sb.id, "printf '#!/bin/sh\\necho PASS\\n' > /workspace/runner")
    # ...and the trainer's later write of the answer does not show through the link.
    h.rt.files(sb.id, platform=True).write("/tests/expected", b"new-secret\n")
    assert b"new-secret" not in h.sh(sb.id, "cat /workspace/hl").stdout
    _stage(h, sb.id, "evaluate")
    assert h.ok(sb.id, "/tests/run.sh").strip() == "FAIL"
    assert h.ok(sb.id, "stat -c %h /tests/expected /workspace/hl").split() == ["1", "1"]  # two inodes now
    assert h.ok(sb.id, "cat /tests/expected").strip() == "new-secret"


# --------------------------------------------------------------- read-only ----


def test_read_only_paths(h: RuntimeHarness, sb: Any) -> None:
    _stage(h, sb.id, "rollout")
    assert "root:x:0:0" in h.ok(sb.id, "cat /etc/passwd")
    assert h.ok(sb.id, "/bin/busybox echo runs").strip() == "runs"  # execute is allowed
    for cmd in (
        "echo x >> /etc/passwd",
        ": > /etc/passwd",
        "truncate -s 0 /etc/passwd",
        "mv /etc/passwd /etc/passwd2",
        "mv /etc/passwd /tmp/passwd",
        "rm /etc/passwd",
        "touch /etc/new",
        "mkdir /etc/newdir",
        "rm /bin/sh",
        "ln -sf /tmp/evil /bin/cat",
        "cp /bin/busybox /bin/busybox2",
        "mv /etc /etc2",
        "chmod 777 /etc/passwd && echo x >> /etc/passwd",
    ):
        _fails(h, sb.id, cmd)
    assert "root:x:0:0" in h.ok(sb.id, "cat /etc/passwd")


def test_writable_and_default_rw(h: RuntimeHarness, sb: Any) -> None:
    _stage(h, sb.id, "rollout")
    h.ok(sb.id, "echo hi > /workspace/f && mkdir -p /workspace/d/e && mv /workspace/f /workspace/d/e/g && cat /workspace/d/e/g")
    h.ok(sb.id, "echo t > /tmp/t && rm /tmp/t && echo x > /dev/null && ls / >/dev/null")
    h.ok(sb.id, "mv /workspace/answer /tmp/answer && mv /tmp/answer /workspace/answer")  # across siblings (REFER)
    # Documented: new entries directly in a directory on the way to a rule (here "/") are refused.
    _fails(h, sb.id, "mkdir /newtop")


def test_default_read_only(h: RuntimeHarness, sb: Any) -> None:
    _stage(h, sb.id, "locked")
    h.ok(sb.id, "echo ok > /workspace/answer && echo t > /tmp/t && echo x > /dev/null && cat /etc/passwd >/dev/null")
    for cmd in ("touch /etc/x", "touch /root/x", "echo x > /tests/expected", "mkdir /home/u", "rm /tests/run.sh"):
        _fails(h, sb.id, cmd)


def test_nested_rules_deepest_wins(h: RuntimeHarness, sb: Any) -> None:
    _stage(h, sb.id, "nested")
    h.ok(sb.id, "echo ok > /workspace/answer")
    # Documented: /workspace lies on the way to /workspace/private, so entries directly in it
    # keep their access but new ones cannot be made there.
    _fails(h, sb.id, "mkdir /workspace/new")
    _fails(h, sb.id, "cat /workspace/private/key")
    assert h.ok(sb.id, "cat /workspace/private/open/notes").strip() == "notes"
    _fails(h, sb.id, "echo x > /workspace/private/open/notes")
    _fails(h, sb.id, "touch /etc/x")


def test_symlinked_rule_path_gets_no_grant(h: RuntimeHarness, sb: Any) -> None:
    # The agent replaces the writable /workspace with a symlink to /tests before the switch.
    h.ok(sb.id, "rm -rf /workspace && ln -s /tests /workspace")
    _stage(h, sb.id, "locked")
    ev = [e for e in h.rt.events(sb.id) if e["event"] == "stage_changed"][-1]
    assert ev["symlinked_rule_paths"] == ["/workspace"]  # the trainer sees the tampering
    _fails(h, sb.id, "echo pwned > /workspace/expected")
    _fails(h, sb.id, "echo pwned > /tests/expected")
    _fails(h, sb.id, "touch /workspace/new")
    assert SECRET in h.ok(sb.id, "cat /tests/expected")


# ------------------------------------------------------------ the switch ----


def test_processes_from_before_the_switch_are_killed(h: RuntimeHarness, sb: Any) -> None:
    async def scenario() -> tuple[Any, Any, Any]:
        rt = h.rt
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            proc = await rt.start_process(sb.id, ["/bin/sh", "-c", "exec 3</tests/expected; sleep 1000"],
                                          stdin=r, stdout=w, stderr=w)
        finally:
            os.close(r)
            os.close(w)
        await rt.exec(sb.id, "setsid sh -c 'sleep 999' >/dev/null 2>&1 < /dev/null &")
        sess = await rt.open_session(sb.id)
        await sess.run("cd /tests")
        await rt.set_stage(sb.id, "rollout")
        ex = await asyncio.wait_for(asyncio.shield(proc.exited), 5)
        with pytest.raises(SessionClosed, match="stage 'rollout'"):
            await sess.run("cat expected")
        fresh = await rt.open_session(sb.id)
        res = await fresh.run("cat /tests/expected")
        await fresh.close()
        return ex, res, rt.events(sb.id)

    ex, res, events = h.run(scenario())
    assert ex.signal == signal.SIGKILL
    assert res.exit_code != 0 and SECRET.encode() not in res.stdout
    ps = h.ok(sb.id, "ps -o args")
    assert "sleep 1000" not in ps and "sleep 999" not in ps
    changed = [e for e in events if e["event"] == "stage_changed"]
    assert changed[-1]["from"] == "setup" and changed[-1]["to"] == "rollout" and changed[-1]["killed"] >= 3
    assert h.pids(sb.id) == [sb.init_pid] or len(h.pids(sb.id)) == 1


def test_unknown_stage_is_a_typed_error(h: RuntimeHarness, sb: Any) -> None:
    with pytest.raises(InvalidSpec, match=r"no stage 'grading' \(declared: evaluate, locked, nested, rollout, setup\)"):
        _stage(h, sb.id, "grading")
    assert h.rt.current_stage(sb.id) == "setup"


def test_create_starts_in_the_spec_stage(h: RuntimeHarness) -> None:
    rec = h.run(h.rt.create(_spec("rollout")))
    try:
        _fails(h, rec.id, "cat /tests/expected")
    finally:
        h.destroy(rec.id)


def test_stage_persists_across_runtime_restart(make_runtime: Callable[[str], RuntimeHarness], tmp_path: Path) -> None:
    from dsec.images import build_from_dir

    h1 = make_runtime("stagerst").start()
    ws = tmp_path / "ws"
    (ws / "tests").mkdir(parents=True)
    (ws / "tests" / "expected").write_text(SECRET + "\n")
    build_from_dir(h1.rt.store, ws, name="stagews", tag="test", kind="workspace")
    rec = h1.run(h1.rt.create(_spec()))
    h1.run(h1.rt.set_stage(rec.id, "rollout"))
    h1.close(destroy_all=False)
    h2 = make_runtime("stagerst").start()
    try:
        assert rec.id in h2.rt.reconciled["adopted"]
        assert h2.rt.current_stage(rec.id) == "rollout"
        _fails(h2, rec.id, "cat /tests/expected")
        h2.run(h2.rt.set_stage(rec.id, "setup"))
        assert SECRET in h2.ok(rec.id, "cat /tests/expected")
    finally:
        h2.close()
    assert h2.leftovers() == []


# ----------------------------------------------------------------- pristine ----


def _host_mounts(h: RuntimeHarness) -> set[str]:
    """The host's overlay mounts and mounts under this runtime's directories (others' test
    runs on this machine add and remove unrelated mounts meanwhile)."""
    return {ln.split(" ", 2)[2] for ln in mountinfo_lines()
            if " - overlay " in ln or str(h.run_dir) in ln or str(h.state_dir) in ln}


def test_pristine_copies_win_over_replaced_files(h: RuntimeHarness, sb: Any) -> None:
    # The agent rewrites the test runner, fakes the answer file's checker and replaces /bin/sh.
    h.ok(sb.id, "printf '#!/bin/busybox sh\\necho PASS\\n' > /tests/run.sh; echo wrong > /tests/expected")
    h.ok(sb.id, "rm /bin/sh && printf '#!/bin/busybox sh\\necho HACKED\\n' > /bin/sh && chmod 755 /bin/sh")
    assert h.ok(sb.id, ["/tests/run.sh"]).strip() == "PASS"  # the agent's world
    assert h.ok(sb.id, ["/bin/sh", "-c", "echo real"]).strip() == "HACKED"
    before = _host_mounts(h)
    out = h.run(h.rt.exec(sb.id, ["/tests/run.sh"], pristine=["/tests", "/bin"], timeout=60))
    assert out.stdout.decode().strip() == "FAIL", out
    assert h.run(h.rt.exec(sb.id, ["/bin/sh", "-c", "echo real"], pristine=["/bin"])).stdout.strip() == b"real"
    # The agent's answer still counts (only the named paths are the image's)...
    h.rt.files(sb.id).write("/workspace/answer", f"{SECRET}\n".encode())  # (its /bin/sh is fake now)
    assert h.run(h.rt.exec(sb.id, ["/tests/run.sh"], pristine=["/tests", "/bin"])).stdout.strip() == b"PASS"
    # ...and cannot be faked by unmounting the copies from inside.
    r = h.run(h.rt.exec(sb.id, ["/bin/sh", "-c", "umount /tests; umount -l /tests; umount /bin; cat /tests/expected"],
                        pristine=["/tests", "/bin"]))
    assert r.stdout.decode().strip() == SECRET, r
    # Nothing of it shows afterwards, in the sandbox or on the host.
    assert h.ok(sb.id, ["/bin/busybox", "cat", "/tests/expected"]).strip() == "wrong"
    assert h.ok(sb.id, ["/bin/sh", "-c", "echo real"]).strip() == "HACKED"
    assert _host_mounts(h) == before
    assert "/tests" not in h.ok(sb.id, ["/bin/busybox", "cat", "/proc/self/mountinfo"])


def test_pristine_over_paths_replaced_by_symlinks(h: RuntimeHarness, sb: Any) -> None:
    h.ok(sb.id, "rm /tests/run.sh && ln -s /workspace/fake /tests/run.sh && "
                "printf '#!/bin/busybox sh\\necho PASS\\n' > /workspace/fake && chmod 755 /workspace/fake")
    # The deepest directory the sandbox left intact (/tests) gets the image's copy.
    out = h.run(h.rt.exec(sb.id, ["/tests/run.sh"], pristine=["/tests/run.sh"]))
    assert out.stdout.strip() == b"FAIL"
    h.ok(sb.id, "rm -rf /tests && ln -s /workspace /tests")
    with pytest.raises(ExecError, match="removed or replaced") as exc:
        h.run(h.rt.exec(sb.id, ["/tests/run.sh"], pristine=["/tests"]))
    assert exc.value.stage == "pristine"  # type: ignore[attr-defined]


def test_pristine_path_must_be_in_the_image(h: RuntimeHarness, sb: Any) -> None:
    h.ok(sb.id, "mkdir /opt2 && echo x > /opt2/f")
    with pytest.raises(ExecError, match="not in the image layers") as exc:
        h.run(h.rt.exec(sb.id, "true", pristine=["/opt2"]))
    assert exc.value.stage == "pristine"  # type: ignore[attr-defined]
    with pytest.raises(ExecError, match="symlink in the image"):
        h.run(h.rt.exec(sb.id, "true", pristine=["/bin/sh"]))
    with pytest.raises(InvalidSpec):
        h.run(h.rt.exec(sb.id, "true", pristine=["relative"]))
    with pytest.raises(InvalidSpec):
        h.run(h.rt.exec(sb.id, "true", pristine="/tests"))


def test_pristine_with_stage_rules(h: RuntimeHarness, sb: Any) -> None:
    h.ok(sb.id, "echo wrong > /tests/expected")
    _stage(h, sb.id, "evaluate")
    r = h.run(h.rt.exec(sb.id, "cat /tests/expected; echo x > /tests/expected", pristine=["/tests"]))
    assert r.stdout.decode().strip() == SECRET and r.exit_code != 0
    _stage(h, sb.id, "rollout")
    r = h.run(h.rt.exec(sb.id, "cat /tests/expected", pristine=["/tests"]))
    assert r.exit_code != 0 and SECRET.encode() not in r.stdout  # hidden stays hidden


def test_pristine_start_process(h: RuntimeHarness, sb: Any) -> None:
    h.ok(sb.id, "echo wrong > /tests/expected")

    async def run() -> bytes:
        r, w = os.pipe2(os.O_CLOEXEC)
        i_r, i_w = os.pipe2(os.O_CLOEXEC)
        try:
            proc = await h.rt.start_process(sb.id, ["/bin/cat", "/tests/expected"], stdin=i_r, stdout=w, stderr=w,
                                            pristine=["/tests"])
        finally:
            os.close(w)
            os.close(i_r)
            os.close(i_w)
        await asyncio.wait_for(asyncio.shield(proc.exited), 10)
        data = os.read(r, 4096)
        os.close(r)
        return data

    assert h.run(run()).strip() == SECRET.encode()


def test_measure_stages_reports_its_figures(h: RuntimeHarness) -> None:
    from dsec.bench.stages import measure_stages

    figures = h.run(measure_stages(h.rt, _spec(None), n=3))
    assert set(figures) == {"stage_switch_p50_ms", "exec_landlock_p50_ms", "exec_plain_p50_ms"}
    assert all(v > 0 for v in figures.values())


def test_hard_link_into_a_default_read_only_area_is_broken(h: RuntimeHarness, sb: Any) -> None:
    h.ok(sb.id, "ln /etc/passwd /workspace/pw")
    _stage(h, sb.id, "locked")  # default ro, /workspace writable
    h.ok(sb.id, "echo 'evil::0:0::/:/bin/sh' >> /workspace/pw")
    assert "evil" not in h.ok(sb.id, "cat /etc/passwd")


def test_pristine_in_a_sandbox_started_from_a_snapshot(h: RuntimeHarness, sb: Any) -> None:
    # The agent's edit is packed into a snapshot: it is not "pristine" in the children.
    h.ok(sb.id, "echo wrong > /tests/expected")
    layer = h.run(h.rt.snapshot(sb.id, name="stagesnap", tag="t1"))
    child = h.run(h.rt.create(_spec().model_copy(update={"image": ImageRef(base=layer.digest)})))
    try:
        assert h.ok(child.id, "cat /tests/expected").strip() == "wrong"
        r = h.run(h.rt.exec(child.id, "cat /tests/expected", pristine=["/tests"]))
        assert r.stdout.decode().strip() == SECRET
    finally:
        h.destroy(child.id)  # (the layer stays in the test's store: pinned for a grace period)


def test_set_stage_applies_the_stage_network_policy(h: RuntimeHarness) -> None:
    from dsec.spec import NetRule, NetworkPolicy

    policy = NetworkPolicy(rules=(NetRule(cidr="192.0.2.7/32", ports=("443",)),))
    stages = {**STAGES, "online": Stage(network=policy)}
    rec = h.run(h.rt.create(_spec().model_copy(update={"stages": stages})))
    try:
        assert h.rt.network_info(rec.id) is None  # loopback only
        h.run(h.rt.set_stage(rec.id, "online"))
        info = h.rt.network_info(rec.id)
        assert info is not None and info["policy"] == policy.model_dump(mode="json")
        h.run(h.rt.set_stage(rec.id, "rollout"))
        info = h.rt.network_info(rec.id)
        assert info is not None and info["policy"] is None
        kinds = [e["event"] for e in h.rt.events(rec.id)]
        assert kinds.count("policy_changed") == 2 and kinds.count("stage_changed") == 2
    finally:
        h.destroy(rec.id)


def test_pristine_with_a_single_image_layer(h: RuntimeHarness) -> None:
    rec = h.create()  # busybox alone: one layer
    try:
        h.ok(rec.id, "rm /bin/sh && printf '#!/bin/busybox sh\\necho HACKED\\n' > /bin/sh && chmod 755 /bin/sh")
        assert h.ok(rec.id, ["/bin/sh", "-c", "echo real"]).strip() == "HACKED"
        r = h.run(h.rt.exec(rec.id, ["/bin/sh", "-c", "echo real; ls /etc/passwd"], pristine=["/bin", "/etc"]))
        assert r.stdout.decode().split() == ["real", "/etc/passwd"], r
    finally:
        h.destroy(rec.id)
