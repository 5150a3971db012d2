"""The `dsec` command as a person uses it (issue 11), against a real all-in-one (`dsec up`
in its own process): complete output, `docker cp` semantics, one-line errors, the event
log, `dsec top`, and a start-up path that imports nothing heavy. Every CLI call is a
subprocess, as from a shell."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import cli_all_in_one

pytestmark = pytest.mark.root
DSEC = [sys.executable, "-m", "dsec.cli.main"]
MiB = 1 << 20


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    ws = _workspace(tmp_path_factory.mktemp("ws"))
    with cli_all_in_one("dsec-test-cliuse-", ["--from-dir", str(ws), "--name", "ws", "--kind", "workspace"]) as ready:
        yield ready


def _workspace(data: Path) -> Path:
    src = data / "ws-src"
    (src / "work").mkdir(parents=True)
    (src / "work" / "README").write_text("a workspace\n")
    return src


def dsec(env: dict[str, str], *args: str, stdin: bytes | None = None, timeout: float = 120
         ) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*DSEC, *args], env=env, capture_output=True, input=stdin, timeout=timeout)


@pytest.fixture
def sid(up: dict[str, str]) -> Iterator[str]:
    r = dsec(up, "create", "busybox")
    assert r.returncode == 0, r.stderr
    box = r.stdout.decode().strip()
    yield box
    dsec(up, "rm", box)


# ----------------------------------------------------------------- output (item 5) --


def test_50_mb_arrive_byte_for_byte_even_through_a_slow_reader(up: dict[str, str], sid: str) -> None:
    made = dsec(up, "exec", sid, "--", "sh", "-c", "head -c 52428800 /dev/urandom > /tmp/big; sha256sum /tmp/big")
    assert made.returncode == 0, made.stderr
    want = made.stdout.split()[0].decode()
    proc = subprocess.Popen([*DSEC, "exec", sid, "--", "cat", "/tmp/big"], env=up, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    time.sleep(2)  # a reader that is behind: the edge used to drop what passed its 8 MiB buffer
    got = hashlib.sha256()
    n = 0
    while chunk := proc.stdout.read(1 << 16):
        got.update(chunk)
        n += len(chunk)
    err = proc.stderr.read()
    assert proc.wait(60) == 0, err
    assert n == 50 * MiB and got.hexdigest() == want
    assert err == b""  # no "output truncated", no "Task was destroyed"


def test_a_complete_1_mb_output_has_no_notice(up: dict[str, str], sid: str) -> None:
    for args in (["exec", sid], ["run", "busybox"]):
        r = dsec(up, *args, "--", "sh", "-c", "head -c 1048575 /dev/zero | tr '\\0' x; echo")
        assert r.returncode == 0, r.stderr
        assert r.stdout == b"x" * (MiB - 1) + b"\n"
        assert r.stderr == b"", r.stderr


def test_over_the_cap_head_and_tail_are_printed_and_the_rest_counted(up: dict[str, str], sid: str) -> None:
    full = "".join(f"{i}\n" for i in range(1, 100001)).encode()
    cap = 64 * 1024
    for args in (["exec", "--output-cap", "64K", sid], ["run", "--output-cap", "64K", "busybox"]):
        r = dsec(up, *args, "--", "seq", "1", "100000")
        assert r.returncode == 0, r.stderr
        assert r.stdout == full[:cap] + full[-cap:]
        lines = r.stderr.decode().splitlines()
        assert len(lines) == 1, lines
        assert f"left out {len(full) - 2 * cap} bytes of stdout" in lines[0], lines


# ------------------------------------------------------------- `dsec cp` (item 7) --


def _tree(root: Path) -> None:
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "dir" / "a").write_text("a\n")
    (root / "dir" / "sub" / "b").write_text("b\n")
    (root / "dir" / "link").symlink_to("a")
    (root / "f").write_text("file\n")


def _find(env: dict[str, str], sid: str, path: str) -> list[str]:
    r = dsec(env, "exec", sid, "--", "sh", "-c", f"cd {path} && find . | sort")
    assert r.returncode == 0, r.stderr
    return r.stdout.decode().split()


def test_cp_follows_docker_cp(up: dict[str, str], sid: str, tmp_path: Path) -> None:
    _tree(tmp_path)
    d, f = str(tmp_path / "dir"), str(tmp_path / "f")
    tree = [".", "./a", "./link", "./sub", "./sub/b"]
    # (SRC, DEST, where the copy lands in the sandbox, what is there afterwards)
    cases = [
        (d, f"{sid}:/root/", "/root/dir", tree),               # a directory into an existing one
        (d, f"{sid}:/root/", "/root/dir", tree),               # again, onto itself: files and symlinks replaced
        (d, f"{sid}:/root/new", "/root/new", tree),            # DEST did not exist: made, with dir's contents
        (d + "/.", f"{sid}:/tmp/", "/tmp", [".", *tree[1:]]),  # dir/. : the contents
        (f, f"{sid}:/root/", "/root/f", None),                 # a file onto a directory goes inside it
        (f, f"{sid}:/root/g", "/root/g", None),                # a file to a new name
    ]
    for src, dst, landed, listing in cases:
        r = dsec(up, "cp", src, dst)
        assert r.returncode == 0 and r.stderr == b"", (src, dst, r.stderr)
        if listing is not None:
            assert _find(up, sid, landed) == listing, (src, dst)
        else:
            assert dsec(up, "exec", sid, "--", "cat", landed).stdout == b"file\n"
    assert dsec(up, "exec", sid, "--", "readlink", "/root/dir/link").stdout == b"a\n"  # a symlink stays one
    # out of the sandbox
    out = tmp_path / "out"
    out.mkdir()
    for src, dst, landed in [(f"{sid}:/root/dir", str(out), out / "dir"),          # into an existing directory
                             (f"{sid}:/root/dir", str(out / "copy"), out / "copy"),  # a new name
                             (f"{sid}:/root/f", str(out), out / "f")]:
        r = dsec(up, "cp", src, dst)
        assert r.returncode == 0 and r.stderr == b"", (src, dst, r.stderr)
        assert landed.exists(), landed
    assert (out / "dir" / "sub" / "b").read_text() == "b\n" and os.readlink(out / "dir" / "link") == "a"
    assert (out / "f").read_text() == "file\n"
    # `-`: a tar stream out (entries dir/...) and in
    r = dsec(up, "cp", f"{sid}:/root/dir", "-")
    assert r.returncode == 0, r.stderr
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as tar:
        assert sorted(tar.getnames()) == ["dir", "dir/a", "dir/link", "dir/sub", "dir/sub/b"]
    assert dsec(up, "cp", "-", f"{sid}:/srv/", stdin=r.stdout).returncode == 1  # no such directory
    assert dsec(up, "exec", sid, "--", "mkdir", "/srv").returncode == 0
    r2 = dsec(up, "cp", "-", f"{sid}:/srv/", stdin=r.stdout)
    assert r2.returncode == 0, r2.stderr
    assert dsec(up, "exec", sid, "--", "cat", "/srv/dir/sub/b").stdout == b"b\n"
    # refused before anything is written: a directory never replaces a file, nor a file a directory
    assert dsec(up, "exec", sid, "--", "sh", "-c", "rm -r /root/dir/sub && echo x > /root/dir/sub").returncode == 0
    (tmp_path / "dir" / "a").write_text("changed\n")
    r = dsec(up, "cp", d, f"{sid}:/root/")
    assert r.returncode == 1 and b"would replace a non-directory with a directory" in r.stderr, r.stderr
    assert dsec(up, "exec", sid, "--", "cat", "/root/dir/a").stdout == b"a\n"  # nothing was written
    r = dsec(up, "cp", f, f"{sid}:/root/dir/sub/")
    assert r.returncode == 1 and b"is not a directory" in r.stderr, r.stderr


# ------------------------------------------------------- one-line errors (item 9) --


def test_bad_input_is_one_line_without_a_traceback(up: dict[str, str], tmp_path: Path) -> None:
    gone = dsec(up, "create", "busybox").stdout.decode().strip()
    assert dsec(up, "rm", gone).returncode == 0
    unreachable = {**up, "DSEC_URL": "http://127.0.0.1:9"}
    # (env, args, exit code, what the line says)
    table = [
        (up, ["run", "--memory", "1M", "busybox", "--", "true"], 2, "--memory 1M: must be at least 16M"),
        (up, ["run", "--cpu", "0", "busybox", "--", "true"], 2, "--cpu 0: must be more than 0"),
        (up, ["run", "--cpu", "-1", "busybox", "--", "true"], 2, "--cpu -1: must be more than 0"),
        (up, ["create", "--memory", "1M", "busybox"], 2, "--memory 1M: must be at least 16M"),
        (up, ["create", "-n", "2", "--cpu", "-1", "busybox"], 2, "--cpu -1: must be more than 0"),
        (up, ["run", "--memory", "lots", "busybox", "--", "true"], 2, "'lots' is not a size"),
        (unreachable, ["ls"], 1, "cannot reach the DSec control plane at http://127.0.0.1:9"),
        (unreachable, ["exec", gone, "--", "true"], 1, "connection refused"),
        (unreachable, ["snapshot", "ls"], 1, "cannot reach the DSec control plane at http://127.0.0.1:9"),
        (up, ["exec", gone, "--", "true"], 1, f"sandbox {gone} is stopped (deleted): it no longer exists"),
        (up, ["shell", gone], 1, f"sandbox {gone} is stopped (deleted)"),
        (up, ["cp", f"{gone}:/etc/hosts", str(tmp_path)], 1, f"sandbox {gone} is stopped (deleted)"),
        (up, ["cp", str(tmp_path), f"{gone}:/root"], 1, f"sandbox {gone} is stopped (deleted)"),
        (up, ["cp", f"{gone}:relative/x", str(tmp_path)], 2, "must be absolute"),
        (up, ["run", "ws", "--", "true"], 2, "'ws' is a workspace layer, not a base"),
        (up, ["run", "no-such-image", "--", "true"], 1, "no-such-image"),
    ]
    for env, args, code, says in table:
        r = dsec(env, *args)
        err = r.stderr.decode()
        assert r.returncode == code, (args, r.returncode, err)
        assert len(err.splitlines()) == 1 and says in err, (args, err)
        assert "Traceback" not in err
    # the workspace layer works where it belongs: over a base
    r = dsec(up, "run", "busybox", "--workspace", "ws", "--", "cat", "/work/README")
    assert r.returncode == 0 and r.stdout == b"a workspace\n", r.stderr


def test_connect_to_a_deleted_sandbox_raises_not_found(up: dict[str, str]) -> None:
    from dsec import SandboxNotFound
    from dsec.sdk import Client

    with Client(up["DSEC_URL"], up["DSEC_TOKEN"]) as c:
        sb = c.create(_spec())
        sb.close()
        with pytest.raises(SandboxNotFound, match="deleted"):
            c.connect(sb.id)


def _spec() -> object:
    from dsec.spec import ImageRef, SandboxSpec

    return SandboxSpec(image=ImageRef(base="busybox"))


# ------------------------------------------- stderr, events, top (item 8) --


def test_ordinary_calls_print_nothing_on_stderr(up: dict[str, str], sid: str) -> None:
    for args in (["exec", sid, "--", "echo", "hi"], ["exec", sid, "--", "false"], ["ls"],
                 ["events", sid], ["network", sid]):
        r = dsec(up, *args)
        assert r.returncode in (0, 1) and r.stderr == b"", (args, r.stderr)
    other = dsec(up, "create", "busybox").stdout.decode().strip()
    r = dsec(up, "rm", other)
    assert r.returncode == 0 and r.stderr == b"removed 1\n", r.stderr
    # the SDK's sync client, an iterator left unfinished: its loop closes it (no "Task was
    # destroyed ... async_generator_athrow", no hang at exit)
    script = ("import sys\nfrom dsec.sdk import Client\n"
              f"c = Client()\nit = c.connect({sid!r}).exec_stream(['sh', '-c', 'echo a; sleep 1; echo b'])\n"
              "print(next(it).data)\nc.close()\n")
    r = subprocess.run([sys.executable, "-c", script], env=up, capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stdout == b"b'a\\n'\n" and r.stderr == b"", r.stderr


def test_the_event_log_says_what_ran_and_what_was_copied(up: dict[str, str], sid: str, tmp_path: Path) -> None:
    from dsec.sdk import Client

    assert dsec(up, "exec", sid, "--", "sh", "-c", "echo 'a b' > /tmp/x").returncode == 0
    with Client(up["DSEC_URL"], up["DSEC_TOKEN"]) as c, c.connect(sid).session() as sess:  # a shell session
        assert sess.run("cd /tmp").exit_code == 0 and sess.run("cat x").stdout == b"a b\n"
    (tmp_path / "in").write_text("in\n")
    assert dsec(up, "cp", str(tmp_path / "in"), f"{sid}:/tmp/").returncode == 0
    assert dsec(up, "cp", f"{sid}:/tmp/x", str(tmp_path / "out")).returncode == 0
    events = json.loads(dsec(up, "events", sid, "--json").stdout)
    started = [e.get("cmd") for e in events if e["event"] == "exec_started"]
    assert "sh -c 'echo '\"'\"'a b'\"'\"' > /tmp/x'" in started, started
    said = [(e["event"], e.get("cmd")) for e in events if e["event"].startswith("session_command")]
    assert ("session_command", "cd /tmp") in said and ("session_command", "cat x") in said, said
    assert sum(1 for e in events if e["event"] == "session_command_ended" and e["exit_code"] == 0) >= 2
    assert [e["reason"] for e in events if e["event"] == "session_closed"] == ["closed"]
    assert {(e["event"], e["path"]) for e in events if e["event"] in ("copy_in", "copy_out")} == {
        ("copy_in", "/tmp"), ("copy_out", "/tmp/x")}


def test_top_labels_the_budget_and_lists_each_sandbox(up: dict[str, str], sid: str) -> None:
    busy = subprocess.Popen([*DSEC, "exec", sid, "--", "sh", "-c", "while :; do :; done"], env=up,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = dsec({**up, "COLUMNS": "200"}, "top", "--once")
    finally:
        busy.terminate()
        busy.wait(30)
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr
    assert "cpu budget" in out and "not use" in out
    row = next(line for line in out.splitlines() if sid in line)
    assert "running" in row and " of 1 " in row and "/1G" in row and "/512" in row, row
    cpu = int(row.split("%")[0].split()[-1])
    assert cpu > 0, row  # the busy loop shows


def test_sandbox_stats_through_the_sdk(up: dict[str, str], sid: str) -> None:
    from dsec.sdk import Client

    with Client(up["DSEC_URL"], up["DSEC_TOKEN"]) as c:
        sb = c.connect(sid)
        before = sb.stats()
        sb.exec(["sh", "-c", "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; head -c 4000000 /dev/zero > /tmp/z"])
        after = sb.stats()
    assert before.memory_limit == 1 << 30 and before.pids_limit == 512 and before.cpu_limit == 1.0
    assert after.disk_bytes >= before.disk_bytes + 3_000_000
    assert after.pids >= 1


# ------------------------------------------------------------ start-up (item 10) --


def test_the_exec_path_imports_nothing_heavy(up: dict[str, str], sid: str) -> None:
    script = ("import sys\nfrom dsec.cli.main import main\n"
              f"sys.argv = ['dsec', 'exec', {sid!r}, '--', 'echo', 'ok']\n"
              "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
              "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'pydantic', 'httpx', 'rich', 'asyncio', "
              "'anyio', 'fastapi', 'sqlalchemy'})\n"
              "print(code, heavy, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", script], env=up, capture_output=True, timeout=60)
    assert r.stdout == b"ok\n", r.stderr
    assert r.stderr.decode().strip() == "0 []", r.stderr
    # The console script's form without options skips click too (cli/entry.py), and gives
    # the same answers: the command's output and code, one line for an unknown sandbox.
    script = script.replace("from dsec.cli.main import main", "from dsec.cli.entry import main").replace(
        "'sqlalchemy'}", "'sqlalchemy', 'click'}")
    r = subprocess.run([sys.executable, "-c", script], env=up, capture_output=True, timeout=60)
    assert r.stdout == b"ok\n", r.stderr
    assert r.stderr.decode().strip() == "0 []", r.stderr
    r = subprocess.run([sys.executable, "-c", script.replace(repr(sid), "'sb-nope'")], env=up, capture_output=True,
                       timeout=60)
    assert r.stderr.decode().splitlines() == ["error: no sandbox 'sb-nope' in project 'root'", "1 []"], r.stderr
