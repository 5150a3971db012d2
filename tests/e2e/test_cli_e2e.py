"""The `dsec` command against a real all-in-one (`dsec up` in its own process)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import cli_all_in_one

pytestmark = pytest.mark.root
DSEC = [sys.executable, "-m", "dsec.cli.main"]


@pytest.fixture(scope="module")
def up() -> Iterator[dict[str, str]]:
    with cli_all_in_one("dsec-test-cli-") as ready:
        yield ready


def dsec(env: dict[str, str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DSEC, *args], env=env, capture_output=True, text=True, input=stdin, timeout=120)


def test_run_exits_with_the_command_code(up: dict[str, str]) -> None:
    r = dsec(up, "run", "busybox", "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert r.returncode == 7, r.stderr
    assert r.stdout == "out\n" and "err" in r.stderr


HOG = "x=$(head -c 400000000 /dev/zero | tr '\\0' a); echo ${#x}"
"""A shell holding 400 MB in a variable (anonymous memory)."""


def test_a_limit_that_ends_a_command_is_one_line_on_stderr(up: dict[str, str]) -> None:
    r = dsec(up, "run", "busybox", "--memory", "64M", "--", "sh", "-c", HOG)
    assert r.returncode == 137, r.stderr
    said = [line for line in r.stderr.splitlines() if line.startswith("dsec:")]
    assert said == ["dsec: killed by the memory limit (64 MiB): raise it with --memory / Resources.memory"], r.stderr
    r = dsec(up, "run", "busybox", "--timeout", "0.5", "--", "sleep", "30")
    assert r.returncode == 124
    assert r.stderr.splitlines()[-1] == "dsec: killed by the timeout (0.5 s): raise it with --timeout / timeout=", r.stderr
    sid = dsec(up, "create", "busybox", "--disk", "8M", "--pids", "16").stdout.strip()
    try:
        r = dsec(up, "exec", sid, "--", "dd", "if=/dev/zero", "of=/tmp/big", "bs=1M", "count=20")
        assert r.returncode == 1
        assert r.stderr.splitlines()[-1] == (
            "dsec: the writable layer is full (disk quota 8 MiB): raise it with --disk / Resources.disk"), r.stderr
        r = dsec(up, "exec", sid, "--", "sh", "-c", "while :; do sleep 60 & done")
        assert r.returncode != 0
        assert r.stderr.splitlines()[-1] == (
            "dsec: the pids limit (16 processes) refused a fork: raise it with --pids / Resources.pids"), r.stderr
        r = dsec(up, "exec", sid, "--", "sh", "-c", "echo fails >&2; exit 3")
        assert r.returncode == 3 and r.stderr == "fails\n"  # no limit, no line
    finally:
        dsec(up, "rm", sid)


def test_create_exec_cp_shell_ls_rm(up: dict[str, str], tmp_path: Path) -> None:
    sid = dsec(up, "create", "busybox", "--label", "who=cli").stdout.strip()
    assert sid.startswith("e1-")
    assert dsec(up, "exec", sid, "--", "hostname").stdout.strip() == sid
    (tmp_path / "in.txt").write_text("payload")
    assert dsec(up, "cp", str(tmp_path / "in.txt"), f"{sid}:/tmp/in.txt").returncode == 0
    assert dsec(up, "exec", sid, "--", "cat", "/tmp/in.txt").stdout == "payload"
    assert dsec(up, "cp", f"{sid}:/tmp/in.txt", str(tmp_path / "back.txt")).returncode == 0
    assert (tmp_path / "back.txt").read_text() == "payload"
    sh = dsec(up, "shell", sid, stdin="cd /tmp\nexport X=5\npwd; echo $X\n")
    assert sh.stdout.splitlines()[-2:] == ["/tmp", "5"]
    listed = json.loads(dsec(up, "ls", "--json", "--label", "who=cli").stdout)
    assert [i["id"] for i in listed] == [sid]
    assert dsec(up, "rm", sid).returncode == 0
    assert not [i for i in json.loads(dsec(up, "ls", "--json", "--state", "running").stdout) if i["id"] == sid]


def test_batch_create_and_rm_by_label(up: dict[str, str]) -> None:
    r = dsec(up, "create", "busybox", "-n", "5", "--label", "batch=cli", "--json")
    assert r.returncode == 0, r.stderr
    ids = json.loads(r.stdout)["ids"]
    assert len(set(ids)) == 5
    assert dsec(up, "rm", "--label", "batch=cli").returncode == 0
    assert not json.loads(dsec(up, "ls", "--json", "--label", "batch=cli", "--state", "running").stdout)


def test_rm_says_what_is_true(up: dict[str, str]) -> None:
    """As `docker rm`: an id that does not exist is an error on stderr and exit 1, the others
    are still removed; one that had ended already is said, not counted (issue 28)."""
    sid = dsec(up, "create", "busybox").stdout.strip()
    assert sid.startswith("e1-")
    r = dsec(up, "rm", "nosuch", sid, "e1-000000000000")
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == ["error: no such sandbox: nosuch", "error: no such sandbox: e1-000000000000",
                                     "removed 1"], r.stderr
    assert sid not in dsec(up, "ls").stdout
    r = dsec(up, "rm", sid)
    assert r.returncode == 0 and r.stderr.splitlines() == [f"{sid}: had ended already (stopped (deleted))",
                                                           "removed 0"], r.stderr
    r = dsec(up, "rm", "nosuch")
    assert r.returncode == 1 and r.stderr.splitlines() == ["error: no such sandbox: nosuch", "removed 0"]


def test_run_too_big_for_any_edge_is_not_a_wait(up: dict[str, str]) -> None:
    """More cpu than the edge holds in all (its cores x 8 by default) is refused for good
    with what was asked and the largest edge's capacity; a request that fits once room comes
    back is still told to retry (issue 28)."""
    cap = json.loads(dsec(up, "edge", "ls", "--json").stdout)[0]["health"]["cpu_capacity"]
    big = str(int(cap) + 1)
    r = dsec(up, "run", "busybox", "--cpu", big, "--", "true")
    assert r.returncode == 2, r.stderr  # a bad argument (as a usage error), not a failure to retry
    line, = r.stderr.splitlines()
    assert line.startswith(f"error: --cpu {big}: the sandbox asks for cpu {big}, more than any edge can ever hold: "
                           f"the largest, e1, has cpu {cap:g}, "), line
    assert "retry" not in line and "Traceback" not in r.stderr
    sid = dsec(up, "create", "busybox", "--cpu", f"{cap:g}").stdout.strip()  # the edge full of cpu
    try:
        r = dsec(up, "run", "busybox", "--cpu", "1", "--", "true")
        assert r.returncode == 1 and "no edge can take this sandbox now" in r.stderr and "retry after" in r.stderr
    finally:
        assert dsec(up, "rm", sid).returncode == 0


def test_errors_are_one_clear_line(up: dict[str, str]) -> None:
    r = dsec(up, "run", "no-such-image", "--", "true")
    assert r.returncode == 1
    assert "error:" in r.stderr and "no-such-image" in r.stderr and "Traceback" not in r.stderr
    bad = dsec({**up, "DSEC_TOKEN": "dsk_" + "x" * 43}, "ls")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr


def test_tokens_and_projects(up: dict[str, str]) -> None:
    r = dsec(up, "project", "create", "clip", "--quota", "sandboxes=1,cpu=2,memory=1G")
    assert r.returncode == 0, r.stderr
    tok = dsec(up, "token", "create", "--project", "clip")
    assert tok.returncode == 0, tok.stderr
    secret = tok.stdout.strip()
    env = {**up, "DSEC_TOKEN": secret}
    first = dsec(env, "create", "busybox")
    assert first.returncode == 0, first.stderr
    over = dsec(env, "create", "busybox")
    assert over.returncode == 1 and "quota" in over.stderr.lower()
    assert dsec(env, "rm", "--all").returncode == 0


def test_task_cli_sets_scheduling_and_shows_a_preemption(up: dict[str, str]) -> None:
    """`dsec task`: create, set (what is not named stays), show, ls, its sandboxes and the
    scheduler's events, on a real preemption: an evaluation create pauses a background
    sandbox that holds the edge's whole cpu budget (issue 28)."""
    cap = json.loads(dsec(up, "edge", "ls", "--json").stdout)[0]["health"]["cpu_capacity"]
    r = dsec(up, "task", "create", "bg", "--priority", "background", "--max", f"sandboxes=4,cpu={cap:g},memory=2G",
             "--json")
    assert r.returncode == 0, r.stderr
    made = json.loads(r.stdout)
    assert (made["priority"], made["preemption"], made["quota"]["sandboxes"]) == (100, "pause", 4)
    r = dsec(up, "task", "set", "bg", "--no-burst")
    assert r.returncode == 0, r.stderr
    shown = dict(line.split(None, 1) for line in dsec(up, "task", "show", "bg").stdout.splitlines())
    assert shown["priority"] == "background (100)" and shown["burst"] == "no" and shown["preemption"] == "pause"
    assert shown["max"] == f"sandboxes=4,cpu={cap:g},memory=2G"  # kept: set named only --no-burst
    r = dsec(up, "task", "set", "nosuch", "--priority", "background")
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "nosuch" in r.stderr, r.stderr
    r = dsec(up, "task", "set", "bg")
    assert r.returncode == 2 and "nothing to set" in r.stderr
    r = dsec(up, "task", "create", "bad", "--min", "sandboxes=1")
    assert r.returncode == 2 and "missing cpu, memory" in r.stderr, r.stderr
    assert dsec(up, "task", "create", "ev", "--priority", "evaluation").returncode == 0

    low = dsec(up, "create", "busybox", "--task", "bg", "--cpu", f"{cap:g}", "--memory", "64M").stdout.strip()
    try:
        high = dsec(up, "create", "busybox", "--task", "ev", "--cpu", "1", "--memory", "64M")
        assert high.returncode == 0, high.stderr  # room made by pausing the background sandbox
        listed = json.loads(dsec(up, "task", "sandboxes", "bg", "--json").stdout)
        assert [(s["id"], s["state"], s["preemption"]["action"]) for s in listed] == [(low, "paused", "pause")]
        table = dsec(up, "task", "sandboxes", "bg").stdout
        assert low in table and "pause by priority 300" in table
        evs = json.loads(dsec(up, "task", "events", "bg", "--json").stdout)
        assert [(e["kind"], e["sandbox_id"], e["action"], e["by_priority"]) for e in evs] == [
            ("preempted", low, "pause", 300)]
        assert "evaluation" in dsec(up, "task", "events", "bg").stdout
        names = [line.split()[0] for line in dsec(up, "task", "ls").stdout.splitlines()[1:]]
        assert {"bg", "ev"} <= set(names)
        r = dsec(up, "task", "events", "ev")
        assert r.returncode == 0 and "no scheduling events" in r.stderr
    finally:
        assert dsec(up, "rm", "--task", "bg").returncode == 0
        assert dsec(up, "rm", "--task", "ev").returncode == 0
