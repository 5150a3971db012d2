"""Per-sandbox limits on the real kernel: memory, pids, cpu, disk, open files, output.

Each limit must hold inside the sandbox and cost the host nothing: the OOM
killer fires inside only, a fork bomb stops at pids.max, a busy loop is
throttled, a disk fill stops with ENOSPC, ``yes`` costs bounded memory, and
the sandbox keeps answering afterwards.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess

import pytest

from conftest import (
    PROBE_PATH,
    MiB,
    RuntimeHarness,
    pid_alive,
    proc_cmdline,
    proc_status,
    wait_until,
)
from dsec.errors import ExecTimeout, FileAccessError

pytestmark = pytest.mark.root


def _rss_kib() -> int:
    return int(proc_status(os.getpid())["VmRSS"].split()[0])


def test_memory_limit_oom_kills_inside_only(rtx: RuntimeHarness) -> None:
    host_sentinel = subprocess.Popen(["sleep", "300"])
    try:
        with rtx.sandbox(memory=64 * MiB) as victim, rtx.sandbox(memory=64 * MiB) as neighbour:
            rtx.ok(neighbour.id, "sleep 300 >/dev/null 2>&1 &")
            rtx.ok(victim.id, "sleep 301 >/dev/null 2>&1 &")
            rtx.probe(victim.id, "kcmp")  # uploads the probe
            r = rtx.sh(victim.id, [PROBE_PATH, "alloc=256"])
            assert r.signal == signal.SIGKILL and r.exit_code is None, r
            assert b"alloc" not in r.stdout  # it never finished
            st = rtx.rt.stats(victim.id)
            assert st["oom_kills"] >= 1, st
            assert st["memory_max_bytes"] <= 64 * MiB, st
            # The sandbox lives on: its init and its other processes survived.
            assert pid_alive(victim.init_pid)
            assert rtx.ok(victim.id, "echo alive").strip() == "alive"
            assert any(proc_cmdline(p)[-1:] == ["301"] for p in rtx.pids(victim.id))
            # Nothing outside was touched.
            assert rtx.rt.stats(neighbour.id)["oom_kills"] == 0
            assert any(proc_cmdline(p)[-1:] == ["300"] for p in rtx.pids(neighbour.id))
            assert host_sentinel.poll() is None
    finally:
        host_sentinel.kill()
        host_sentinel.wait()


def test_pids_limit_stops_a_fork_bomb(rtx: RuntimeHarness) -> None:
    with rtx.sandbox(pids=64) as sb:
        r = rtx.sh(sb.id, "i=0; while [ $i -lt 200 ]; do sleep 60 >/dev/null 2>&1 & i=$((i+1)); done; echo looped", timeout=60)
        assert b"fork" in r.stderr.lower() or b"resource temporarily unavailable" in r.stderr.lower(), r
        st = rtx.rt.stats(sb.id)
        assert st["pids_limit_hits"] > 0, st
        assert len(rtx.pids(sb.id)) <= 64
        assert st["pids"] <= 64
        # Still usable: an exec joins the cgroup even when it is full (migration is not
        # a fork), kills the bomb from inside, and the sandbox answers again.
        rtx.sh(sb.id, ["killall", "-9", "sleep"])
        assert wait_until(lambda: len(rtx.pids(sb.id)) <= 2, timeout=5), rtx.pids(sb.id)
        assert rtx.ok(sb.id, "echo a; echo b | cat").split() == ["a", "b"]
        assert pid_alive(sb.init_pid)


def test_cpu_limit_throttles(rtx: RuntimeHarness) -> None:
    with rtx.sandbox(cpu=0.2) as sb:
        with pytest.raises(ExecTimeout) as ei:
            rtx.sh(sb.id, ["awk", "BEGIN { while (1) {} }"], timeout=1.2)
        res = ei.value.result
        st = rtx.rt.stats(sb.id)
        assert st["cpu_throttled"] > 0, st
        assert st["cpu_throttled_s"] > 0, st
        # Generous sanity only: 20% of a core for ~1.2 s is ~0.24 s; unthrottled would be ~1.2 s.
        used = res.cpu_user_s + res.cpu_system_s
        assert used < 0.7, (used, res)
        assert rtx.ok(sb.id, "echo ok").strip() == "ok"


@pytest.mark.parametrize("medium", ["disk", "memory"])
def test_disk_quota_gives_enospc(rtx: RuntimeHarness, medium: str) -> None:
    with rtx.sandbox(disk=8 * MiB, disk_medium=medium) as sb:
        r = rtx.sh(sb.id, "dd if=/dev/zero of=/tmp/big bs=1M count=20")
        assert r.exit_code != 0, r
        # tmpfs says ENOSPC, the disk store's quota EDQUOT.
        assert b"No space left on device" in r.stderr or b"Disk quota exceeded" in r.stderr, r
        size = int(rtx.ok(sb.id, "stat -c %s /tmp/big"))
        assert size <= 8 * MiB
        r = rtx.sh(sb.id, "head -c 20000000 /dev/zero > /tmp/big2")
        assert r.exit_code != 0, r  # busybox head reports ENOSPC as "I/O error"
        # The files API hits the same wall, with a typed error.
        with pytest.raises(FileAccessError) as ei:
            rtx.rt.files(sb.id).write("/tmp/api-big", b"\0" * (12 * MiB))
        assert ei.value.errno in (errno.ENOSPC, errno.EDQUOT), ei.value
        assert "quota" in str(ei.value) or "space" in str(ei.value)
        # Space comes back when files go.
        rtx.ok(sb.id, "rm -f /tmp/big /tmp/big2 /tmp/api-big")
        rtx.ok(sb.id, "dd if=/dev/zero of=/tmp/small bs=1M count=4 2>/dev/null")
        assert rtx.ok(sb.id, "stat -c %s /tmp/small").strip() == str(4 * MiB)


def test_nofile_rlimit(rtx: RuntimeHarness) -> None:
    with rtx.sandbox(nofile=100) as sb:
        assert rtx.ok(sb.id, "ulimit -n").strip() == "100"
        # Root inside cannot raise the hard limit (no CAP_SYS_RESOURCE).
        assert rtx.sh(sb.id, "ulimit -n 4096").exit_code != 0


def test_yes_is_capped(rtx: RuntimeHarness) -> None:
    cap = 64 * 1024
    with rtx.sandbox(output_cap=cap) as sb:
        rss_before = _rss_kib()
        with pytest.raises(ExecTimeout) as ei:
            rtx.sh(sb.id, ["yes"], timeout=1.0)
        res = ei.value.result
        assert res.timed_out == "timeout"
        assert res.truncated is True
        assert res.stdout_bytes > 16 * cap, res.stdout_bytes  # yes ran for a while
        marker = f"\n[... dsec: {res.stdout_bytes - 2 * cap} bytes omitted ...]\n".encode()
        assert len(res.stdout) <= 2 * cap + len(marker)
        assert res.stdout.startswith(b"y\n" * 100)
        assert res.stdout.endswith(b"y\n")
        assert marker in res.stdout
        assert res.stderr == b"" and res.stderr_bytes == 0
        # The host paid bounded memory: not a copy of everything yes wrote.
        grown_kib = _rss_kib() - rss_before
        assert grown_kib < 64 * 1024, f"test process grew by {grown_kib} KiB for {res.stdout_bytes} bytes of output"
        # The exec's tree is gone and the sandbox still works.
        assert rtx.pids(sb.id) == [sb.init_pid]
        assert rtx.ok(sb.id, "echo fine").strip() == "fine"


def test_default_output_cap_is_per_exec_overridable(rtx: RuntimeHarness, sb) -> None:
    r = rtx.sh(sb.id, "head -c 100000 /dev/zero | tr '\\0' a", output_cap=1024)
    assert r.stdout_bytes == 100000
    assert r.truncated
    assert r.stdout.startswith(b"a" * 1024) and r.stdout.endswith(b"a" * 1024)
    assert len(r.stdout) < 1024 * 2 + 100
    r = rtx.sh(sb.id, "head -c 100000 /dev/zero | tr '\\0' a")
    assert r.stdout == b"a" * 100000 and not r.truncated
