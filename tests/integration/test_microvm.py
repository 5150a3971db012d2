"""The microVM backend on real QEMU microVMs (TCG here): what only a VM has.

The conformance suite (tests/conformance, kind ``microvm``) covers what every backend does;
these cases cover the rest: a fork continues the parent's running machine (its processes and
memory), clones never share an identity or random bytes, the guest sees none of the host, a
guest that panics leaves its sandbox failed with a reason and its neighbours working, bad
kernels and settings are refused with what to fix, and templates are tied to their machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dsec.errors import DsecError, HostError, InvalidSpec, SandboxFailed

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]

MiB = 1 << 20


class VMs:
    """A started microVM backend over the busybox layer, with its own loop."""

    def __init__(self, base: Path, seed: Path, name: str, **config: Any) -> None:
        from dsec.backends.microvm.backend import MicroVMBackend
        from dsec.backends.microvm.config import MicroVMConfig
        from dsec.images.store import LocalLayerStore

        self.store = LocalLayerStore(base / f"layers-{name}")
        self.store.add_erofs(seed, name="busybox", tag="test", kind="base")
        self.be = MicroVMBackend(MicroVMConfig(**config), name=name, state_dir=base / f"state-{name}",
                                 run_dir=base / "run", id_prefix="vt", store=self.store)
        self.runner = asyncio.Runner()

    def run(self, coro: Any, timeout: float = 120) -> Any:
        async def bounded() -> Any:
            async with asyncio.timeout(timeout):
                return await coro
        return self.runner.run(bounded())

    def spec(self, **res: Any) -> Any:
        from dsec.spec import ImageRef, Resources, SandboxSpec

        res.setdefault("memory", 64 * MiB)
        res.setdefault("disk", 64 * MiB)
        return SandboxSpec(image=ImageRef(base="busybox:test"), backend="microvm", resources=Resources(**res))

    def create(self, **res: Any) -> Any:
        return self.run(self.be.create(self.spec(**res)))

    def sh(self, sid: str, cmd: str, **kw: Any) -> Any:
        kw.setdefault("timeout", 60)
        return self.run(self.be.exec(sid, cmd, **kw))

    def ok(self, sid: str, cmd: str) -> str:
        r = self.sh(sid, cmd)
        assert r.exit_code == 0, (cmd, r)
        return str(r.stdout.decode())

    def close(self) -> None:
        try:
            self.run(self.be.close())
        finally:
            self.runner.close()


@pytest.fixture(scope="module")
def vms(dsec_base: Path, busybox_seed: Path) -> Iterator[VMs]:
    import shutil

    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (scripts/setup.sh installs QEMU 10 from bookworm-backports)")
    v = VMs(dsec_base, busybox_seed, f"tvm{os.getpid() % 10000}")
    v.run(v.be.start())
    try:
        yield v
    finally:
        v.close()
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and
                 b"qemu-system" in _read(p / "cmdline") and v.be.name.encode() in _read(p / "cmdline")]
    assert not leftovers, leftovers


def _read(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError:
        return b""


def test_a_fork_continues_the_running_machine_with_fresh_identities(vms: VMs) -> None:
    parent = vms.create()
    # a process that keeps a count in its memory, and says it on SIGUSR1
    vms.ok(parent.id, "sh -c 'n=0; trap \"echo \\$n > /root/count\" USR1; "
                      "while :; do n=$((n+1)); sleep 0.1; done' >/dev/null 2>&1 & echo $! > /root/pid")
    time.sleep(2)
    vms.ok(parent.id, "echo kept > /root/file")
    kids = vms.run(vms.be.fork(parent.id, 2))
    try:
        ids = {parent.id, *(k.id for k in kids)}
        facts = {}
        for k in kids:
            out = vms.ok(k.id, "kill -USR1 $(cat /root/pid); sleep 1; cat /root/count; cat /root/file; hostname; "
                               "cat /etc/machine-id; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
            count, kept, host, mid, rnd = out.split()
            assert int(count) >= 10 and kept == "kept"  # the process, its memory and the disk went on in the child
            assert host == k.id
            facts[k.id] = (mid, rnd)
        parent_mid = vms.ok(parent.id, "cat /etc/machine-id").strip()
        mids = [f[0] for f in facts.values()] + [parent_mid]
        rnds = [f[1] for f in facts.values()]
        assert len(set(mids)) == 3 and len(set(rnds)) == 2, facts  # never the same identity or random bytes
        assert len(ids) == 3
        vms.ok(kids[0].id, "echo mine > /root/file")
        assert vms.ok(parent.id, "cat /root/file") == "kept\n"  # independent after the fork
    finally:
        for k in kids:
            vms.run(vms.be.destroy(k.id))
        vms.run(vms.be.destroy(parent.id))


def test_two_clones_of_one_template_never_share_identity_or_random_bytes(vms: VMs) -> None:
    a, b = vms.create(), vms.create()
    try:
        cmd = "cat /etc/machine-id; hostname; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'"
        fa, fb = vms.ok(a.id, cmd).split(), vms.ok(b.id, cmd).split()
        assert fa[0] != fb[0] and fa[2] != fb[2], (fa, fb)
        assert (fa[1], fb[1]) == (a.id, b.id)
        assert "localhost" in vms.ok(a.id, "cat /etc/hosts")
    finally:
        vms.run(vms.be.destroy(a.id))
        vms.run(vms.be.destroy(b.id))


def test_the_guest_sees_none_of_the_host(vms: VMs) -> None:
    sb = vms.create()
    try:
        host_kernel = Path("/proc/sys/kernel/osrelease").read_text().strip()
        assert vms.ok(sb.id, "uname -r").strip() != host_kernel  # its own kernel
        seen = vms.ok(sb.id, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '")
        assert "pytest" not in seen and "qemu" not in seen and "/init" in seen  # the guest's processes only
        sock_dir = str(vms.be.sock_dir)
        r = vms.sh(sb.id, f"ls {sock_dir} /run/dsec-vm-* 2>&1; ls / ")
        assert "qmp" not in r.stdout.decode() and ".agent" not in r.stdout.decode()
        r = vms.sh(sb.id, "ls /dev/vport* /dev/vd* 2>&1")
        assert r.exit_code != 0  # neither the agent's port nor the disks
    finally:
        vms.run(vms.be.destroy(sb.id))


def test_qemu_runs_in_its_sandboxs_network_namespace_and_reaches_none_of_the_host(vms: VMs) -> None:
    """QEMU runs in the sandbox's own network namespace (not the host's): it and the guest
    reach nothing the policy does not allow, the host's loopback services included; the
    guest's eth0 is the host's to set; destroying the VM leaves its namespace clean."""
    import socket

    from dsec.backends.common.netfilter import in_netns, nft
    from dsec.backends.microvm.network import GUEST_IP, NAT_TABLE

    def has_tap() -> bool:
        try:
            socket.if_nametoindex("vm0")
        except OSError:
            return False
        return True

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    sb = vms.create()
    fd = vms.be._netns_of(sb.id)
    try:
        assert fd is not None
        rec = vms.be.get(sb.id)
        assert os.stat(f"/proc/{rec.qemu_pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
        assert rec.net is not None and vms.be.network_info(sb.id) is None  # a namespace, no policy: loopback only
        assert in_netns(fd, has_tap)
        assert f"inet {GUEST_IP}/30" in vms.ok(sb.id, "ip -4 addr show eth0")
        # refused at once (the namespace's reset reaches the guest), not after a timeout, even
        # where the guest's address is also a real one elsewhere (this host's own is 192.0.2.2)
        t0 = time.monotonic()
        r = vms.sh(sb.id, "nc -w 8 10.1.2.3 80 </dev/null")
        assert r.exit_code != 0 and time.monotonic() - t0 < 5, (r, time.monotonic() - t0)
        r = vms.sh(sb.id, "ip link set eth0 down; ip addr add 10.9.9.9/24 dev eth0")
        assert r.exit_code != 0 and b"not permitted" in r.stderr.lower(), r  # no CAP_NET_ADMIN in the guest
        # the host's loopback services are not QEMU's: its namespace's loopback has nothing
        assert in_netns(fd, lambda: socket.socket().connect_ex(("127.0.0.1", port))) != 0
    finally:
        vms.run(vms.be.destroy(sb.id))
        srv.close()
    try:  # the namespace went back to the pool without the VM's tap and NAT table
        assert fd is not None
        listing = in_netns(fd, lambda: nft("list ruleset"))
        assert NAT_TABLE not in listing and "table inet dsec" in listing
        assert not in_netns(fd, has_tap)
    finally:
        if fd is not None:
            os.close(fd)


def test_a_guest_that_panics_fails_its_sandbox_and_spares_its_neighbours(vms: VMs) -> None:
    from dsec.spec import SandboxState

    victim, neighbour = vms.create(), vms.create()
    try:
        with contextlib.suppress(DsecError):  # the connection may go with the guest
            vms.sh(victim.id, "echo c > /proc/sysrq-trigger", timeout=20)
        deadline = time.monotonic() + 20
        while vms.be.get(victim.id).state is not SandboxState.FAILED and time.monotonic() < deadline:
            vms.run(asyncio.sleep(0.2))
        rec = vms.be.get(victim.id)
        assert rec.state is SandboxState.FAILED and "QEMU" in rec.reason, (rec.state, rec.reason)
        with pytest.raises(DsecError):
            vms.sh(victim.id, "true")
        assert vms.ok(neighbour.id, "echo fine") == "fine\n"
    finally:
        vms.run(vms.be.destroy(victim.id))
        vms.run(vms.be.destroy(neighbour.id))


def test_a_full_disk_and_a_fork_bomb_leave_the_vm_answering(vms: VMs) -> None:
    sb = vms.create(disk=16 * MiB, pids=64)
    try:
        r = vms.sh(sb.id, "dd if=/dev/zero of=/root/big bs=1M count=64")
        assert r.exit_code != 0 and r.limit is not None and r.limit.kind == "disk_full", r
        r = vms.sh(sb.id, "i=0; while [ $i -lt 200 ]; do sleep 30 & i=$((i+1)); done; wait", timeout=20)
        assert r.limit is not None and r.limit.kind in ("pids", "timeout"), r
        vms.sh(sb.id, "killall -9 sleep; rm -f /root/big")
        assert vms.ok(sb.id, "echo alive") == "alive\n"
    finally:
        vms.run(vms.be.destroy(sb.id))


def test_bad_settings_are_refused_with_what_to_fix(vms: VMs, dsec_base: Path, busybox_seed: Path) -> None:
    with pytest.raises(InvalidSpec, match="vCPUs"):
        vms.create(cpu=64)
    with pytest.raises(InvalidSpec, match="disk_medium"):
        vms.create(disk_medium="memory")
    missing = VMs(dsec_base, busybox_seed, "tvmbadk", kernel=dsec_base / "no-such-vmlinux")
    try:
        with pytest.raises((HostError, DsecError), match="no-such-vmlinux"):
            missing.run(missing.be.start())
    finally:
        missing.close()


def test_a_kernel_that_does_not_boot_fails_the_create_in_time_and_leaves_nothing(dsec_base: Path,
                                                                                 busybox_seed: Path) -> None:
    junk = dsec_base / "junk-vmlinux"
    junk.write_bytes(os.urandom(1 << 20))
    from dsec.backends.microvm.guest import ensure_guest

    real = ensure_guest()
    v = VMs(dsec_base, busybox_seed, "tvmjunk", kernel=junk, initrd=real.initrd, boot_timeout_s=5.0, boot_attempts=1)
    try:
        v.run(v.be.start())
        t0 = time.monotonic()
        with pytest.raises(SandboxFailed, match="did not boot"):
            v.create()
        assert time.monotonic() - t0 < 30
        assert v.be.list() == []
        assert not any((v.be.sock_dir).iterdir())
        assert not v.be.cgroups.existing()
    finally:
        v.close()


def test_a_template_is_tied_to_its_machine(vms: VMs) -> None:
    sb = vms.create()
    try:
        tmpl = vms.be.templates.get_ready(sb.template)
        m = tmpl.machine
        assert replace(m, qemu_build=m.qemu_build + " other").template_key() != m.template_key()
        assert replace(m, guest_digest="0" * 64).template_key() != m.template_key()
        assert replace(m, memory_mib=m.memory_mib + 1).template_key() != m.template_key()
        # a saved template whose record names another machine is not adopted: it is removed
        meta = tmpl.upper.parent / "template.json"
        import json

        doc = json.loads(meta.read_text())
        doc["machine"]["qemu_build"] = "another QEMU"
        meta.write_text(json.dumps(doc))
        kept = vms.be.templates.adopt()
        assert sb.template not in kept and not meta.parent.exists()  # removed, never restored into
        vms.be.templates._templates.pop(sb.template, None)
        again = vms.create()  # the next create makes the template afresh
        assert vms.ok(again.id, "echo ok") == "ok\n"
        vms.run(vms.be.destroy(again.id))
    finally:
        vms.run(vms.be.destroy(sb.id))


def test_quiet_vms_are_stopped_until_their_next_call_and_busy_ones_are_not(dsec_base: Path,
                                                                          busybox_seed: Path) -> None:
    v = VMs(dsec_base, busybox_seed, "tvmquiet", idle_stop_s=1.0, zram_size=1 << 30)
    try:
        v.run(v.be.start())
        quiet, busy = v.create(), v.create()
        v.ok(busy.id, "sh -c 'while :; do :; done' >/dev/null 2>&1 &")  # busy on its own: CPU, no channel
        before = v.be.cgroups.memory_bytes(quiet.id)
        deadline = time.monotonic() + 20
        while not v.be._vms[quiet.id].quiet_stopped and time.monotonic() < deadline:
            v.run(asyncio.sleep(0.5))
        v.run(asyncio.sleep(2))  # its memory pushed out meanwhile
        assert v.be._vms[quiet.id].quiet_stopped
        assert not v.be._vms[busy.id].quiet_stopped
        assert v.be.cgroups.memory_bytes(quiet.id) < before / 2, (before, v.be.cgroups.memory_bytes(quiet.id))
        assert v.ok(quiet.id, "echo back") == "back\n"  # the next call runs it again first
        assert not v.be._vms[quiet.id].quiet_stopped
    finally:
        v.close()


def test_a_restarted_backend_adopts_running_and_paused_vms_with_their_network(dsec_base: Path,
                                                                            busybox_seed: Path) -> None:
    """close(destroy_all=False) leaves the VMs running; a new backend object of the same name
    adopts them: a running one answers, a paused one stays paused (its vCPUs stopped) until
    resumed, and both keep their network namespace."""
    import shutil

    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (scripts/setup.sh installs QEMU 10 from bookworm-backports)")
    name = f"tvr{os.getpid() % 10000}"
    first = VMs(dsec_base, busybox_seed, name)
    first.run(first.be.start())
    a, b = first.create(), first.create()
    first.ok(a.id, "echo kept-a > /root/a")
    first.ok(b.id, "echo kept-b > /root/b")
    first.run(first.be.pause(b.id))
    ns = {sid: os.stat(f"/proc/{first.be.get(sid).qemu_pid}/ns/net").st_ino for sid in (a.id, b.id)}
    first.run(first.be.close(destroy_all=False))
    first.runner.close()
    second = VMs(dsec_base, busybox_seed, name)
    try:
        second.run(second.be.start())
        assert sorted(second.be.reconciled["adopted"]) == sorted([a.id, b.id]), second.be.reconciled
        assert second.be.get(b.id).state.value == "paused"
        from dsec.backends.common.procstat import cpu_ticks

        pid = second.be.get(b.id).qemu_pid
        t0 = cpu_ticks(pid)
        time.sleep(1.0)
        assert cpu_ticks(pid) - t0 <= 1  # frozen again after the greeting: no CPU while paused
        assert second.ok(a.id, "cat /root/a") == "kept-a\n"
        second.run(second.be.resume(b.id))
        assert second.ok(b.id, "cat /root/b") == "kept-b\n"
        for sid in (a.id, b.id):
            rec = second.be.get(sid)
            assert os.stat(f"/proc/{rec.qemu_pid}/ns/net").st_ino == ns[sid]
            assert sid in second.be.net.sandboxes  # its namespace's slot is held again
    finally:
        second.close()
