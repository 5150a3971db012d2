"""The session leak check counts only what this session's runtimes named (tests/ownership.py):
claim files read from a real claims directory, real processes as holders."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import ENV_MARK, RT_PREFIX, SESSION_TOKEN, _ours
from dsec.backends.common.claims import net_tag
from ownership import NameWatch, own_cgroups, own_mount, own_netns, own_table


def _claim(d: Path, name: str, pid: int) -> None:
    (d / f"runtime-{name}").write_text(f"{name} pid {pid}\n")


def test_names_held_by_the_session_and_only_those(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    monkeypatch.setenv("DSEC_CLAIMS_DIR", str(claims))
    # a child of the session carries its mark; a process started with a clean environment
    # (standing in for a user's own `dsec up`) does not
    mine = subprocess.Popen(["sleep", "30"], env={**os.environ, ENV_MARK: SESSION_TOKEN})
    theirs = subprocess.Popen(["sleep", "30"], env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    try:
        watch = NameWatch(RT_PREFIX, _ours, interval=0.05)
        _claim(claims, "up-aaaaaaaa-e1", mine.pid)
        _claim(claims, "up-bbbbbbbb-e1", theirs.pid)
        _claim(claims, "up-cccccccc-e1", os.getpid())  # an in-process cluster of the session
        _claim(claims, f"{RT_PREFIX}-x", 1)  # the session's prefix, whoever holds it
        (claims / "nettag-abcd").write_text("up-bbbbbbbb-e1 pid 1\n")  # not a runtime claim
        (claims / "runtime-up-dddddddd-e1").write_text("garbage\n")
        watch.start()
        watch.stop()
        assert watch.names == {"up-aaaaaaaa-e1", "up-cccccccc-e1", f"{RT_PREFIX}-x"}
        assert watch.owns("up-aaaaaaaa-e1") and watch.owns(f"{RT_PREFIX}-later")
        assert not watch.owns("up-bbbbbbbb-e1") and not watch.owns("up-dddddddd-e1")
        # a name seen once stays the session's after its instance stopped (what it left is a leak)
        (claims / "runtime-up-aaaaaaaa-e1").unlink()
        watch.poll()
        assert watch.owns("up-aaaaaaaa-e1")
    finally:
        for p in (mine, theirs):
            p.kill()
            p.wait()

    ours, other = "/tmp/dsec-test-sX/", "/tmp/elsewhere/"
    line = "100 1 0:50 / {point} rw,relatime - {kind} {source} rw"
    assert own_mount(line.format(point="/run/dsec/up-aaaaaaaa-e1/skel", kind="tmpfs", source="dsec-skel"), watch, [ours])
    assert not own_mount(line.format(point="/run/dsec/up-bbbbbbbb-e1/skel", kind="tmpfs", source="dsec-skel"),
                         watch, [ours])
    assert not own_mount(line.format(point="/var/lib/dsec/up-bbbbbbbb-e1/x", kind="erofs", source="/dev/loop3"),
                         watch, [ours])
    assert own_mount(line.format(point=f"{other}l", kind="erofs", source=f"{ours}layers/blob.erofs"), watch, [ours])
    assert not own_mount(line.format(point=f"{other}l", kind="erofs", source=f"{other}blob.erofs"), watch, [ours])

    assert own_table(f"table inet dsec_host_{net_tag('up-aaaaaaaa-e1')}", watch)
    assert own_table(f"table ip dsec_nat_{net_tag(f'{RT_PREFIX}-x')}", watch)
    assert not own_table(f"table inet dsec_host_{net_tag('up-bbbbbbbb-e1')}", watch)
    assert own_table("table inet dsec_something_else", watch)  # names no runtime: counted

    assert own_netns(f"dsec-cfnet-{SESSION_TOKEN}", SESSION_TOKEN) and own_netns("dsec-test-remote", SESSION_TOKEN)
    other_token = "abc123" if SESSION_TOKEN != "abc123" else "def456"
    assert not own_netns(f"dsec-cfnet-{other_token}", SESSION_TOKEN)  # another test session's

    root = tmp_path / "cgroup"
    for hier in ("memory", "pids"):
        for name in ("up-aaaaaaaa-e1", "up-bbbbbbbb-e1", f"{RT_PREFIX}-y"):
            (root / hier / "dsec" / name).mkdir(parents=True)
    (root / "cpu").mkdir()
    assert sorted(f"{p.parent.parent.name}/{p.name}" for p in own_cgroups(root, watch)) == sorted([
        "memory/up-aaaaaaaa-e1", f"memory/{RT_PREFIX}-y", "pids/up-aaaaaaaa-e1", f"pids/{RT_PREFIX}-y"])
