"""Writable layers on the node's disk (``Resources.disk_medium``), on the real kernel.

A disk-medium sandbox writes into its own btrfs subvolume under a hard quota:
its files are page cache, not memory it is charged for, so a sandbox with
128 MiB of memory writes a gigabyte and reads it back; writes past the quota
fail with EDQUOT, never an OOM kill; destroy returns the space; a crashed
runtime's subvolumes are found by name. The memory medium keeps the tmpfs.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from conftest import MiB, RuntimeHarness, mountinfo_lines, wait_until

pytestmark = pytest.mark.root

GiB = 1 << 30


def _sandbox_superblocks(init_pid: int) -> set[str]:
    """Filesystems (major:minor) mounted in the sandbox that the host does not have."""
    def devs(pid: int | str) -> set[str]:
        out = set()
        with open(f"/proc/{pid}/mountinfo") as f:
            for ln in f:
                out.add(ln.split()[2])
        return out

    return devs(init_pid) - devs("self")


def _store_used(rtx: RuntimeHarness) -> int:
    """Bytes the runtime's store holds once btrfs has dropped deleted subvolumes."""
    mnt = str(rtx.rt.uppers.mountpoint)
    subprocess.run(["btrfs", "subvolume", "sync", mnt], check=True, capture_output=True, timeout=300)
    subprocess.run(["btrfs", "filesystem", "sync", mnt], check=True, capture_output=True, timeout=300)
    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_small_memory_writes_a_gigabyte_and_reads_it_back(rtx: RuntimeHarness) -> None:
    with rtx.sandbox(memory=128 * MiB, disk=2 * GiB) as sb:
        r = rtx.sh(sb.id, "head -c 1073741824 /dev/urandom > /root/big; echo rc=$?; sha256sum /root/big",
                   timeout=300)
        assert r.exit_code == 0 and r.signal is None, r
        assert r.stdout.decode().startswith("rc=0\n"), r
        inside = r.stdout.decode().split("\n")[1].split()[0]
        st = rtx.rt.stats(sb.id)
        assert st["oom_kills"] == 0, st
        # The file is intact as the host sees it in the sandbox's subvolume.
        h = hashlib.sha256()
        with open(rtx.rt.uppers.path(sb.id) / "upper" / "root" / "big", "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        assert h.hexdigest() == inside
        use = rtx.rt.disk_usage(sb.id)
        assert GiB <= use.used <= GiB + 64 * MiB, use
        assert use.limit == 2 * GiB
        # Page cache is charged while written and read, then reclaimed within the limit.
        assert st["memory_bytes"] <= 128 * MiB, st


def test_writing_past_the_quota_is_edquot_not_an_oom_kill(rtx: RuntimeHarness) -> None:
    with rtx.sandbox(memory=128 * MiB, disk=256 * MiB) as sb:
        r = rtx.sh(sb.id, "dd if=/dev/zero of=/root/big bs=1M count=600; echo rc=$?", timeout=120)
        assert r.exit_code == 0 and r.signal is None, r  # the shell survives: no kill
        assert b"Disk quota exceeded" in r.stderr, r
        assert b"rc=1" in r.stdout, r
        assert rtx.rt.stats(sb.id)["oom_kills"] == 0
        assert rtx.rt.disk_usage(sb.id).free < 1 * MiB
        # /dev/shm is inside the same quota, and space comes back when files go.
        assert rtx.sh(sb.id, "head -c 1048576 /dev/zero > /dev/shm/x").exit_code != 0
        rtx.ok(sb.id, "rm /root/big && head -c 1048576 /dev/zero > /dev/shm/x && ls -l /dev/shm/x")


@pytest.mark.parametrize("medium", ["disk", "memory"])
def test_each_medium_is_what_it_says(rtx: RuntimeHarness, medium: str) -> None:
    with rtx.sandbox(disk_medium=medium, disk=64 * MiB) as sb:
        own = _sandbox_superblocks(sb.init_pid)
        mi = Path(f"/proc/{sb.init_pid}/mountinfo").read_text()
        shm = next(ln for ln in mi.splitlines() if ln.split()[4] == "/dev/shm")
        if medium == "disk":
            # overlay + proc (+ mqueue, not in mountinfo): nothing else of the sandbox's own.
            assert len(own) == 2, (own, mi)
            assert " btrfs " in shm and str(rtx.rt.uppers.path(sb.id)) not in mi
            assert (rtx.rt.uppers.path(sb.id) / "upper").is_dir()
        else:
            assert len(own) == 3, (own, mi)  # + the tmpfs upper
            assert " tmpfs dsec-upper " in shm
            assert not rtx.rt.uppers.path(sb.id).exists()
        rtx.ok(sb.id, "echo hi > /dev/shm/a && cat /dev/shm/a && touch /tmp/t /root/r /etc/e")
        assert rtx.rt.disk_usage(sb.id).limit == 64 * MiB


@pytest.mark.parametrize("medium", ["disk", "memory"])
def test_pause_snapshot_and_fork_keep_the_files_on_either_medium(rtx: RuntimeHarness, medium: str) -> None:
    from dsec.spec import ImageRef, Resources, SandboxSpec

    with rtx.sandbox(disk_medium=medium, disk=64 * MiB, memory=128 * MiB) as sb:
        rtx.ok(sb.id, "mkdir -p /work && head -c 4194304 /dev/urandom > /work/blob && sha256sum /work/blob > /work/sum"
                      " && echo x > /dev/shm/s")
        paused = rtx.run(rtx.rt.pause(sb.id))
        assert paused.reclaim is not None
        rtx.run(rtx.rt.resume(sb.id))
        rtx.ok(sb.id, "sha256sum -c /work/sum")
        layer = rtx.run(rtx.rt.snapshot(sb.id, name=f"disk-{medium}", tag="t"))
        children = rtx.run(rtx.rt.fork(sb.id, 2))
        try:
            for c in children:
                assert c.spec.resources.disk_medium == medium
                rtx.ok(c.id, "sha256sum -c /work/sum && test ! -e /dev/shm/s")  # /dev/shm is not in the image
            spec = SandboxSpec(image=ImageRef(base=layer.digest),
                               resources=Resources(disk_medium=medium, disk=64 * MiB))
            rec = rtx.run(rtx.rt.create(spec))
            try:
                rtx.ok(rec.id, "sha256sum -c /work/sum")
            finally:
                rtx.destroy(rec.id)
        finally:
            for c in children:
                rtx.destroy(c.id)
        rtx.rt.layers.maybe_release(layer.digest)  # skip the grace (1 s) of the runtime's pin
        rtx.rt.store.remove(layer.digest)


@pytest.mark.parametrize("n", [40, pytest.param(1000, marks=pytest.mark.slow)])
def test_destroy_returns_the_space(rtx: RuntimeHarness, n: int) -> None:
    """N sandboxes each write 10 MB and are destroyed: the store's use comes back within 1 %
    of what they wrote (`df` of the store before and after)."""
    with rtx.sandbox(disk=64 * MiB):
        pass
    before = _store_used(rtx)
    ids = [rtx.create(disk=64 * MiB).id for _ in range(n)]
    for sid in ids:
        rtx.ok(sid, "head -c 10485760 /dev/urandom > /root/f && sync")
    during = _store_used(rtx)
    assert during - before >= n * 10 * MiB * 0.95, (before, during)
    for sid in ids:
        rtx.destroy(sid)
    assert not [n for n in rtx.rt.uppers.names() if n in ids]
    after = _store_used(rtx)
    # What stays is btrfs metadata (trees grown for N subvolumes): within 1 % of what was written,
    # and the store's free space within 1 % of what it was.
    assert abs(after - before) <= 0.01 * (during - before), (before, during, after)
    st = os.statvfs(rtx.rt.uppers.mountpoint)
    assert abs(after - before) <= 0.01 * st.f_bavail * st.f_frsize, (before, after)


def test_files_survive_a_runtime_restart_and_orphans_are_removed(make_runtime) -> None:  # type: ignore[no-untyped-def]
    h = make_runtime("diskrestart").start()
    try:
        sb = h.create(disk=64 * MiB)
        h.ok(sb.id, "echo kept > /root/note")
        # A subvolume no record knows (a crash between its creation and the record).
        subprocess.run(["btrfs", "subvolume", "create", str(h.rt.uppers.mountpoint / "sb-000000orphan")],
                       check=True, capture_output=True)
        h.close(destroy_all=False)
        assert any(str(h.rt.uppers.mountpoint) in ln for ln in mountinfo_lines())  # kept for the sandboxes
        h.rt = None
        h.start()
        assert sb.id in h.rt.reconciled["adopted"]
        assert "sb-000000orphan" in h.rt.reconciled["destroyed"]
        assert h.ok(sb.id, "cat /root/note").strip() == "kept"
        assert sorted(h.rt.uppers.names()) == [sb.id]
        h.destroy(sb.id)
        assert h.rt.uppers.names() == []
    finally:
        h.close()
    assert not h.leftovers(), h.leftovers()


def test_two_runtimes_keep_separate_stores(make_runtime) -> None:  # type: ignore[no-untyped-def]
    a = make_runtime("diska").start()
    b = make_runtime("diskb").start()
    try:
        sa, sb_ = a.create(disk=64 * MiB), b.create(disk=64 * MiB)
        assert a.rt.uppers.mountpoint != b.rt.uppers.mountpoint
        assert a.rt.uppers.image != b.rt.uppers.image
        b.ok(sb_.id, "echo b > /root/b")
        a.destroy(sa.id)
        a.close()  # unmounts a's store only
        wait_until(lambda: not a.leftovers(), timeout=10)
        assert b.ok(sb_.id, "cat /root/b && echo more > /root/c").split() == ["b"]
        assert b.rt.uppers.names() == [sb_.id]
    finally:
        a.close()
        b.close()
    assert not a.leftovers() and not b.leftovers(), (a.leftovers(), b.leftovers())


def test_uppers_path_must_be_btrfs(tmp_path: Path) -> None:
    import asyncio

    from dsec.backends.common.uppers import UpperStoreError
    from dsec.backends.container.runtime import ContainerRuntime

    plain = tmp_path / "dsec-plain"
    plain.mkdir()
    rt = ContainerRuntime(name="tdiskplain", state_dir=tmp_path / "dsec-state", run_dir=tmp_path / "dsec-run",
                          uppers_path=plain)
    with pytest.raises(UpperStoreError, match="not a btrfs mount"):
        asyncio.run(rt._setup_uppers())
