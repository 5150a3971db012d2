"""Pause and resume on the real kernel: freezer, zram swap, reclaim, transparent resume.

What must hold (issue 4, "Pause, resume, reclaim"): processes, open files,
sessions and disk survive several pause/resume cycles (checked with
checksums); the memory a paused sandbox held goes back to the host (its
memory cgroup's usage drops); any exec, file or session call resumes a paused
sandbox; pausing twice is a typed error; a restarted runtime re-adopts paused
sandboxes; and the zram device is reused after a restart and removed at the
end, so no swap device outlives the run.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import CGROUP_ROOT, MiB, RuntimeHarness, pid_alive, wait_until
from dsec.backends.common.zram import ZramSwap, active_swaps, read_label, swap_label
from dsec.backends.container.runtime import ContainerRuntime
from dsec.errors import SandboxNotFound, SandboxStateError
from dsec.spec import SandboxState

pytestmark = pytest.mark.root

ZRAM_SIZE = 512 * MiB

# Holds N MiB of text-like (compressible) memory. On SIGUSR1 it re-checks the pattern and
# appends "ok <round> <sum>" through a file descriptor it opened at start (open files survive).
HOG_C = r"""
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
static volatile sig_atomic_t asked;
static void on_usr1(int s) { (void)s; asked = 1; }
int main(int argc, char **argv) {
    size_t n = (size_t)atoi(argv[1]) << 20;
    int log = open(argv[2], O_WRONLY | O_CREAT | O_APPEND, 0644);
    unsigned char *p = malloc(n);
    const char *text = "the quick brown fox jumps over the lazy dog 0123456789 ";
    size_t tl = strlen(text);
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)text[(i * 7 + i / 4096) % tl];
    signal(SIGUSR1, on_usr1);
    dprintf(log, "ready %d\n", (int)getpid());
    for (int round = 1;; ) {
        while (!asked) pause();
        asked = 0;
        unsigned long sum = 0;
        int bad = 0;
        for (size_t i = 0; i < n; i++) {
            sum = sum * 31 + p[i];
            if (p[i] != (unsigned char)text[(i * 7 + i / 4096) % tl]) bad = 1;
        }
        dprintf(log, "%s %d %lu\n", bad ? "BAD" : "ok", round++, sum);
    }
}
"""


@pytest.fixture(scope="module")
def hog(dsec_base: Path) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("needs gcc (a static memory-holding helper runs inside the sandbox)")
    src, out = dsec_base / "hog.c", dsec_base / "dsec-hog"
    src.write_text(HOG_C)
    proc = subprocess.run([gcc, "-static", "-O2", "-o", str(out), str(src)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot build the static helper: {proc.stderr[-300:]}")
    return out


def _with_zram(h: RuntimeHarness, size: int = ZRAM_SIZE) -> RuntimeHarness:
    h.prepare()
    h.rt = ContainerRuntime(name=h.name, state_dir=h.state_dir, run_dir=h.run_dir, zram_size=size)
    return h


def _our_swaps(name: str) -> list[str]:
    label = swap_label(name)
    return [p for p in active_swaps() if read_label(Path(p)) == label]


@pytest.fixture(scope="module")
def prt(make_runtime: Callable[[str], RuntimeHarness]) -> Iterator[RuntimeHarness]:
    """A runtime with a zram swap device; afterwards neither it nor the device may remain."""
    h = _with_zram(make_runtime("pause")).start()
    try:
        yield h
    finally:
        h.close()
    assert not h.leftovers(), h.leftovers()
    assert not _our_swaps(h.name), "zram swap device left after close()"
    assert not (h.run_dir / h.name / "zram.json").exists()


def _memcg(h: RuntimeHarness, sid: str, name: str) -> int:
    return int((CGROUP_ROOT / "memory" / "dsec" / h.name / sid / name).read_text())


def _freezer(h: RuntimeHarness, sid: str) -> str:
    return (CGROUP_ROOT / "freezer" / "dsec" / h.name / sid / "freezer.state").read_text().strip()


def _hog_log(h: RuntimeHarness, sid: str) -> list[str]:
    return h.rt.files(sid).read("/tmp/hog.log").decode().splitlines()


def _check_hog(h: RuntimeHarness, sid: str, pid_inside: str, rounds: int) -> str:
    h.ok(sid, f"kill -USR1 {pid_inside}")
    assert wait_until(lambda: len(_hog_log(h, sid)) >= rounds + 1, timeout=20), _hog_log(h, sid)
    last = _hog_log(h, sid)[-1]
    assert last.startswith(f"ok {rounds} "), last
    return last.split()[2]


def test_pause_resume_cycles_keep_processes_files_sessions_and_disk(prt: RuntimeHarness, hog: Path) -> None:
    h = prt
    with h.sandbox(memory=512 * MiB, disk=256 * MiB) as rec:
        sid = rec.id
        fs = h.rt.files(sid)
        fs.write("/usr/bin/hog", hog.read_bytes(), mode=0o755)
        h.ok(sid, "/usr/bin/hog 96 /tmp/hog.log </dev/null >/dev/null 2>&1 &")
        assert wait_until(lambda: fs.exists("/tmp/hog.log") and bool(_hog_log(h, sid)), timeout=20)
        hog_pid = _hog_log(h, sid)[0].split()[1]
        # 24 MiB of files in the writable layer (tmpfs: it is memory too), half compressible.
        h.ok(sid, "mkdir -p /data && yes 'a line of build output 0123456789' | head -c 16777216 > /data/text"
                  " && head -c 8388608 /dev/urandom > /data/random && ln -s text /data/link"
                  " && chmod 640 /data/random && sha256sum /data/* > /root/sums")
        sums = h.ok(sid, "sha256sum /data/*")
        sess = h.run(h.rt.open_session(sid))
        assert h.run(sess.run("cd /data && X=42")).exit_code == 0
        want_sum = _check_hog(h, sid, hog_pid, 1)
        init_pid, pids = rec.init_pid, set(h.pids(sid))

        resumers: list[tuple[str, Callable[[], Any]]] = [
            ("resume()", lambda: h.run(h.rt.resume(sid))),
            ("exec", lambda: h.ok(sid, "true")),
            ("files", lambda: h.rt.files(sid).read("/root/sums")),
            ("session", lambda: h.run(sess.run("true"))),
        ]
        for cycle, (how, resume) in enumerate(resumers, start=1):
            before = _memcg(h, sid, "memory.usage_in_bytes")
            res = h.run(h.rt.pause(sid))
            assert h.rt.get(sid).state is SandboxState.PAUSED
            assert _freezer(h, sid) == "FROZEN"
            after = _memcg(h, sid, "memory.usage_in_bytes")
            assert res.reclaim is not None
            # >= 90% of what it held is back with the host (the rest: kernel memory).
            assert res.reclaim.returned_frac >= 0.9, (cycle, res)
            assert after <= 0.1 * before, (cycle, before, after)
            assert res.reclaim.swapped >= 64 * MiB, res
            assert h.rt.stats(sid)["state"] == "paused"  # stats do not resume
            assert h.rt.get(sid).state is SandboxState.PAUSED
            resume()
            assert h.rt.get(sid).state is SandboxState.RUNNING, how
            assert _freezer(h, sid) == "THAWED", how
            # Same processes, same memory contents, same open file, same session, same disk.
            assert pid_alive(init_pid) and pids <= set(h.pids(sid)) | {p for p in pids if not pid_alive(p)}
            assert _check_hog(h, sid, hog_pid, cycle + 1) == want_sum, how
            assert h.ok(sid, "sha256sum /data/*") == sums, how
            assert h.run(sess.run("echo $X $(pwd)")).stdout == b"42 /data\n", how
        assert h.ok(sid, "readlink /data/link; stat -c %a /data/random") == "text\n640\n"
        kinds = [e["event"] for e in h.rt.events(sid)]
        assert kinds.count("paused") == 4 and kinds.count("resumed") == 4, kinds


def test_pause_errors_are_typed(prt: RuntimeHarness) -> None:
    h = prt
    with h.sandbox() as rec:
        with pytest.raises(SandboxStateError) as ei:
            h.run(h.rt.resume(rec.id))
        assert ei.value.fields["state"] == "running"
        h.run(h.rt.pause(rec.id))
        with pytest.raises(SandboxStateError) as ei:
            h.run(h.rt.pause(rec.id))
        assert ei.value.fields["state"] == "paused" and "already paused" in str(ei.value)
        assert h.rt.get(rec.id).state is SandboxState.PAUSED  # the failed call changed nothing
        h.run(h.rt.resume(rec.id))
    with pytest.raises(SandboxNotFound):
        h.run(h.rt.pause(rec.id))


def test_destroying_a_paused_sandbox_leaves_nothing(prt: RuntimeHarness) -> None:
    h = prt
    rec = h.create()
    h.ok(rec.id, "sleep 1000 >/dev/null 2>&1 &")
    h.run(h.rt.pause(rec.id))
    t0 = time.monotonic()
    assert h.destroy(rec.id)
    assert time.monotonic() - t0 < 3  # the frozen init was killed, not waited on
    assert not pid_alive(rec.init_pid)
    assert not h.cgroup_dirs(rec.id)
    assert rec.id not in {p.stem for p in h.records()}


def test_group_pause_and_resume(prt: RuntimeHarness) -> None:
    h = prt
    recs = [h.create() for _ in range(6)]
    ids = [r.id for r in recs]
    try:
        for sid in ids:
            h.ok(sid, "echo $HOSTNAME > /tmp/who; sleep 1000 >/dev/null 2>&1 &")
        h.run(h.rt.pause(ids[0]))
        out = h.run(h.rt.pause_many([*ids, "nope-000000000000"]))
        assert sorted(out.done) == sorted(ids[1:]) and out.skipped == [ids[0]], out
        assert list(out.errors) == ["nope-000000000000"]
        assert isinstance(out.errors["nope-000000000000"], SandboxNotFound)
        assert all(h.rt.get(s).state is SandboxState.PAUSED and _freezer(h, s) == "FROZEN" for s in ids)
        h.ok(ids[2], "true")  # one woken by a request
        back = h.run(h.rt.resume_many(ids))
        assert sorted(back.done) == sorted(set(ids) - {ids[2]}) and back.skipped == [ids[2]], back
        assert all(h.rt.get(s).state is SandboxState.RUNNING and _freezer(h, s) == "THAWED" for s in ids)
        for sid in ids:
            assert h.ok(sid, "cat /tmp/who").strip() == sid
    finally:
        for sid in ids:
            h.destroy(sid)


def test_memory_limit_stays_hard_with_swap_on(prt: RuntimeHarness, hog: Path) -> None:
    """With swap on the host, a sandbox must not grow past its memory limit into swap."""
    h = prt
    with h.sandbox(memory=48 * MiB) as rec:
        h.rt.files(rec.id).write("/usr/bin/hog", hog.read_bytes(), mode=0o755)
        r = h.sh(rec.id, "/usr/bin/hog 128 /tmp/log", timeout=60)
        assert r.signal == 9, r  # OOM-killed inside, not swapped
        assert _memcg(h, rec.id, "memory.memsw.max_usage_in_bytes") <= 48 * MiB


def test_restart_readopts_paused_sandboxes_and_reuses_the_zram_device(
    make_runtime: Callable[[str], RuntimeHarness], hog: Path
) -> None:
    h = _with_zram(make_runtime("pause-rs"), 128 * MiB).start()
    closed = False
    try:
        dev = _our_swaps(h.name)
        assert len(dev) == 1
        rec = h.create(memory=256 * MiB)
        h.rt.files(rec.id).write("/usr/bin/hog", hog.read_bytes(), mode=0o755)
        h.ok(rec.id, "/usr/bin/hog 32 /tmp/hog.log </dev/null >/dev/null 2>&1 &")
        assert wait_until(lambda: h.rt.files(rec.id).exists("/tmp/hog.log") and bool(_hog_log(h, rec.id)), timeout=20)
        h.run(h.rt.pause(rec.id))
        h.close(destroy_all=False)  # an upgrade: sandboxes and the swap device stay
        closed = True
        assert _freezer(h, rec.id) == "FROZEN" and _our_swaps(h.name) == dev
        h2 = _with_zram(make_runtime("pause-rs"), 128 * MiB)
        h2.start()
        closed = False
        h = h2
        assert h.rt.reconciled["adopted"] == [rec.id]
        assert h.rt.get(rec.id).state is SandboxState.PAUSED
        assert _our_swaps(h.name) == dev  # reused, not a second device
        assert h.ok(rec.id, "head -1 /tmp/hog.log").startswith("ready")  # resumed by the exec
        assert h.rt.get(rec.id).state is SandboxState.RUNNING
    finally:
        if not closed:
            h.close()
    assert not h.leftovers(), h.leftovers()
    assert not _our_swaps(h.name)


def test_a_leftover_zram_device_is_removed_when_not_configured(
    make_runtime: Callable[[str], RuntimeHarness],
) -> None:
    """A crash leaves the device; a runtime started without swap removes it (no paused sandbox uses it)."""
    h = make_runtime("pause-left").prepare()
    record = h.run_dir / h.name / "zram.json"
    left = ZramSwap(h.name, 32 * MiB, record)
    try:
        left.ensure()
        assert _our_swaps(h.name)
        h.start()
        assert not _our_swaps(h.name) and not record.exists()
    finally:
        h.close()
        left.teardown()
    assert not _our_swaps(h.name)
