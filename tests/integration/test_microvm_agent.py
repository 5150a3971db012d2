"""The microVM guest agent in a real VM: QEMU microvm under TCG (no KVM needed).

One VM for the module: Debian's cloud kernel and the initramfs from
``guest.ensure_guest``, a busybox EROFS base layer (serial ``dsec-l0``) and an ext4
upper (``dsec-up``), booted with the probe's best command line (VM-PROBE.md §1, V6;
retried once, since about one boot in 40 hangs there). The tests talk to it through
``AgentClient`` only. The launcher here is the test's own, not the backend's driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from dsec.backends.microvm import agentwire as w
from dsec.backends.microvm.agent import AgentClient
from dsec.backends.microvm.guest import kernel_cmdline
from dsec.errors import ExecError, FileAccessError, HostError

pytestmark = pytest.mark.root

T = TypeVar("T")
MiB = 1024 * 1024
BOOT_TIMEOUT = 20.0


def _qboot() -> Path | None:
    out = subprocess.run(["dpkg", "-L", "qemu-system-data"], capture_output=True, text=True).stdout
    return next((Path(ln) for ln in out.split() if ln.endswith("/qboot.rom")), None)


class VM:
    """A QEMU microvm and an agent client; ``figures`` collects what the tests measured."""

    def __init__(self, workdir: Path, vmlinux: Path, initrd: Path, disks: list[tuple[Path, str, bool]]) -> None:
        self.workdir = workdir
        self.sock = workdir / "agent.sock"
        self.cmd = [
            "qemu-system-x86_64", "-M", "microvm,x-option-roms=off,isa-serial=off", "-bios", str(_qboot()),
            "-accel", "tcg,thread=single,tb-size=32", "-cpu", "max", "-smp", "1", "-m", "256",
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(vmlinux), "-initrd", str(initrd), "-append", kernel_cmdline("dsec.pids=512"),
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=ag,path={self.sock},server=on,wait=off",
            "-device", "virtserialport,chardev=ag,name=dsec.agent",
        ]
        if os.environ.get("DSEC_VMTEST_CONSOLE"):  # debugging: the guest kernel's log in this file
            self.cmd[2] = "microvm,x-option-roms=off"
            self.cmd += ["-serial", f"file:{os.environ['DSEC_VMTEST_CONSOLE']}"]
            i = self.cmd.index("-append") + 1
            self.cmd[i] = self.cmd[i].replace("console=hvc0 quiet", "console=ttyS0 earlyprintk=ttyS0")
        for i, (path, serial, ro) in enumerate(disks):
            self.cmd += ["-drive", f"if=none,id=d{i},file={path},format=raw{',readonly=on' if ro else ''}",
                         "-device", f"virtio-blk-device,drive=d{i},serial={serial}"]
        self.proc: subprocess.Popen[bytes] | None = None
        self.client: AgentClient | None = None
        self.runner = asyncio.Runner()
        self.figures: dict[str, float] = {}

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        async def bounded() -> T:
            async with asyncio.timeout(timeout):
                return await coro
        return self.runner.run(bounded())

    @property
    def c(self) -> AgentClient:
        assert self.client is not None
        return self.client

    def boot(self) -> None:
        for attempt in range(2):
            self.sock.unlink(missing_ok=True)
            t0 = time.monotonic()
            with open(self.workdir / "qemu.err", "wb") as err:
                self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             stderr=err)
            try:
                self.client = self.run(AgentClient.connect(self.sock, 10, sandbox_id="vmtest"))
                hello = self.run(self.c.hello(BOOT_TIMEOUT))
                self.figures["boot_to_hello_s"] = time.monotonic() - t0
                self.figures["guest_boot_ns"] = hello.boot_ns
                return
            except HostError:
                self.kill()
                if attempt:
                    raise

    def kill(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.run(self.client.close(), timeout=5)
            self.client = None
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def reconnect(self) -> None:
        self.run(self.c.close())
        self.client = self.run(AgentClient.connect(self.sock, 5, sandbox_id="vmtest"))

    def sh(self, script: str, **kw: Any) -> tuple[str, str, w.Exit]:
        out, err, ex = self.run(self.c.run(["sh", "-c", script], **kw))
        return out.decode(), err.decode(), ex


@pytest.fixture(scope="module")
def vm() -> Iterator[VM]:
    if shutil.which("qemu-system-x86_64") is None or _qboot() is None:
        pytest.skip("needs qemu-system-x86 and qemu-system-data (qboot.rom): scripts/setup.sh installs them")
    for tool in ("mkfs.erofs", "mkfs.ext4"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool}")
    from dsec.backends.microvm.guest import DEFAULT_CACHE, ensure_guest
    from dsec.images.busybox import build_busybox_rootfs

    try:
        assets = ensure_guest(DEFAULT_CACHE)
    except HostError as exc:
        pytest.skip(f"no guest image: {exc}")
    work = Path(tempfile.mkdtemp(prefix="dsec-vm-"))
    try:
        root = build_busybox_rootfs(work / "rootfs")
        (root / "tmp").mkdir(exist_ok=True)
        (root / "etc" / "outside-link").symlink_to("../../../../lib/modules/order")
        subprocess.run(["mkfs.erofs", "--quiet", str(work / "base.erofs"), str(root)], check=True, capture_output=True)
        with open(work / "upper.ext4", "wb") as f:
            f.truncate(64 * MiB)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(work / "upper.ext4")], check=True, capture_output=True)
        machine = VM(work, assets.vmlinux, assets.initrd,
                     [(work / "base.erofs", "dsec-l0", True), (work / "upper.ext4", "dsec-up", False)])
        try:
            machine.boot()
            yield machine
        finally:
            machine.kill()
            machine.runner.close()
            print("\nmicrovm agent figures:", {k: round(v, 4) for k, v in machine.figures.items()})
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------ basics ----


def test_hello_and_ping(vm: VM) -> None:
    hello = vm.run(vm.c.hello())
    assert hello.version == 1 and hello.boot_ns > 0 and hello.fail is None
    rtts = [vm.run(vm.c.ping()) for _ in range(50)]
    vm.figures["ping_p50_ms"] = statistics.median(rtts) * 1000
    assert vm.figures["ping_p50_ms"] < 50


def test_exec_argv_env_cwd_user(vm: VM) -> None:
    out, err, ex = vm.sh('echo "$FOO|$1"; pwd; id -u; id -g; env | sort', env=[("FOO", "b a r")], cwd="/tmp",
                         uid=1000, gid=1001)
    assert (ex.code, ex.signal, err) == (0, 0, "")
    assert out.splitlines() == ["b a r|", "/tmp", "1000", "1001", "FOO=b a r", "PWD=/tmp", "SHLVL=1"] or \
        out.splitlines()[:4] == ["b a r|", "/tmp", "1000", "1001"], out
    out2, _, _ = vm.run(vm.c.run(["echo", "a b", "", "c"]))
    assert out2 == b"a b  c\n"
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        vm.run(vm.c.run(["true"]))
        times.append(time.perf_counter() - t0)
    vm.figures["exec_true_p50_ms"] = statistics.median(times) * 1000


def test_exit_codes_and_signals(vm: VM) -> None:
    assert vm.sh("exit 3")[2].code == 3
    ex = vm.sh("kill -TERM $$")[2]
    assert (ex.code, ex.signal) == (-1, signal.SIGTERM)
    out, err, ex = vm.sh("echo out; echo err >&2; exit 1")
    assert (out, err, ex.code) == ("out\n", "err\n", 1)
    assert ex.utime_s >= 0 and ex.stime_s >= 0 and ex.maxrss_kb > 0


def test_missing_binary_and_cwd_are_typed_errors(vm: VM) -> None:
    with pytest.raises(ExecError) as ei:
        vm.run(vm.c.exec(["/no/such/binary"]))
    assert ei.value.errno == errno.ENOENT and ei.value.stage == "exec"
    with pytest.raises(ExecError) as ei:
        vm.run(vm.c.exec(["no-such-command"]))
    assert ei.value.errno == errno.ENOENT
    with pytest.raises(ExecError) as ei:
        vm.run(vm.c.exec(["true"], cwd="/nowhere"))
    assert ei.value.errno == errno.ENOENT and ei.value.stage == "cwd"
    with pytest.raises(ExecError) as ei:
        vm.run(vm.c.exec(["/etc/passwd"]))
    assert ei.value.errno == errno.EACCES


def test_stdin_streamed(vm: VM) -> None:
    data = os.urandom(3 * MiB + 17)
    out, _, ex = vm.run(vm.c.run(["sh", "-c", "cat | md5sum"], stdin_data=data))
    import hashlib

    assert out.split()[0].decode() == hashlib.md5(data).hexdigest() and ex.code == 0
    out, _, _ = vm.run(vm.c.run(["head", "-c", "5"], stdin_data=b"x" * (2 * MiB)))  # reader leaves early
    assert out == b"xxxxx"


def test_big_output_with_backpressure(vm: VM) -> None:
    n = 50 * MiB
    got = 0

    async def go() -> w.Exit:
        nonlocal got
        proc = await vm.c.exec(["sh", "-c", f"yes | head -c {n}"], window=256 * 1024)
        async for fd, data in proc.output():
            assert fd == 1
            got += len(data)
        return await proc.wait()

    t0 = time.perf_counter()
    ex = vm.run(go(), timeout=120)
    vm.figures["output_MBps"] = n / MiB / (time.perf_counter() - t0)
    assert (ex.code, got) == (0, n)


def test_flood_does_not_wedge_the_agent(vm: VM) -> None:
    async def go() -> None:
        flood = await vm.c.exec(["yes"], window=4 * 1024 * 1024)  # never read: its credit runs out
        drain = await vm.c.exec(["sh", "-c", "yes | head -c 100000000"])  # read (and dropped) by wait()
        waiter = asyncio.ensure_future(drain.wait())
        await asyncio.sleep(0.5)
        rtts = [await vm.c.ping(timeout=5) for _ in range(5)]
        assert max(rtts) < 2.0, rtts
        out, _, _ = await vm.c.run(["echo", "still here"])
        assert out == b"still here\n"
        await flood.signal(signal.SIGKILL)
        await drain.signal(signal.SIGKILL)
        assert (await flood.wait()).signal == signal.SIGKILL
        await waiter

    vm.run(go())


def test_tree_kill(vm: VM) -> None:
    async def go() -> None:
        proc = await vm.c.exec(["sh", "-c", "sleep 100 & sleep 100"])
        await asyncio.sleep(0.3)
        await proc.signal(signal.SIGKILL, tree=True)
        ex = await proc.wait(timeout=10)
        assert ex.signal == signal.SIGKILL
        out, _, _ = await vm.c.run(["sh", "-c", "pgrep -x sleep || echo none"])
        assert out == b"none\n"

    vm.run(go())


def test_pty(vm: VM) -> None:
    out, _, ex = vm.run(vm.c.run(["sh", "-c", "test -t 0 && test -t 1 && echo tty; stty size"], tty=True,
                                 size=(30, 100)))
    assert out.replace(b"\r\n", b"\n") == b"tty\n30 100\n" and ex.code == 0

    async def resize() -> bytes:
        got = bytearray()
        proc = await vm.c.exec(["sh"], tty=True, stdin=True, size=(24, 80), on_stdout=got.extend)
        await proc.write_stdin(b"stty size\n")
        await asyncio.sleep(0.3)
        await proc.resize(50, 132)
        await proc.write_stdin(b"stty size; exit 7\n")
        ex = await proc.wait(timeout=10)
        assert ex.code == 7
        return bytes(got)

    text = vm.run(resize())
    assert b"24 80" in text and b"50 132" in text, text


def test_agent_port_is_not_visible_in_the_sandbox(vm: VM) -> None:
    out, _, _ = vm.sh("ls /dev; ls /dev/vport* /dev/hvc* /dev/vd* 2>/dev/null; true")
    names = set(out.split())
    assert names <= {"null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "shm", "fd", "stdin",
                     "stdout", "stderr"}, names
    out, _, _ = vm.sh("cat /proc/mounts")
    # /tmp is on the writable disk (its quota), as in a container
    assert {ln.split()[1] for ln in out.splitlines()} == {"/", "/proc", "/sys", "/dev", "/dev/pts", "/dev/shm"}, out


# ------------------------------------------------------------------- files ----


def test_files_round_trip(vm: VM) -> None:
    c = vm.c

    async def go() -> None:
        await c.mkdir("/work/a/b", parents=True, uid=1000, gid=1000)
        data = os.urandom(1 * MiB + 5)
        assert await c.write("/work/a/b/f.bin", data, mode=0o600, uid=1000, gid=1000) == len(data)
        assert await c.read("/work/a/b/f.bin") == data
        info = await c.stat("/work/a/b/f.bin")
        assert (info.type, info.size, info.mode, info.uid, info.gid) == ("file", len(data), 0o600, 1000, 1000)
        assert (await c.stat("/work/a")).uid == 1000
        await c.write("/work/a/log", b"one\n")
        await c.write("/work/a/log", b"two\n", append=True)
        assert await c.read("/work/a/log") == b"one\ntwo\n"
        names = [(i.name, i.type) for i in await c.list("/work/a")]
        assert names == [("b", "dir"), ("log", "file")]
        await c.rename("/work/a/log", "/work/log2")
        assert not await c.exists("/work/a/log") and await c.exists("/work/log2")
        with pytest.raises(FileAccessError, match="not empty"):
            await c.remove("/work/a")
        await c.remove("/work/a", recursive=True)
        await c.remove("/work/log2")
        assert [i.name for i in await c.list("/work")] == []
        with pytest.raises(FileAccessError, match="no such file") as ei:
            await c.read("/work/nothing")
        assert ei.value.errno == errno.ENOENT and ei.value.sandbox_id == "vmtest"
        with pytest.raises(FileAccessError) as ei:
            await c.read("/etc/passwd", max_bytes=3)
        assert ei.value.errno == errno.EFBIG
        # the shell sees what the files API wrote
        await c.run(["sh", "-c", "mkdir -p /work && echo hi > /work/x"])
        assert (await c.read("/work/x")) == b"hi\n"
        await c.remove("/work", recursive=True)

    vm.run(go())


def test_files_stay_in_the_sandbox_root(vm: VM) -> None:
    c = vm.c

    async def go() -> None:
        passwd = await c.read("/../../etc/passwd")
        assert passwd.startswith(b"root:") and passwd == await c.read("/etc/passwd")
        # /etc/outside-link -> ../../../../lib/modules/order: resolved inside the root, where it is missing
        with pytest.raises(FileAccessError) as ei:
            await c.read("/etc/outside-link")
        assert ei.value.errno == errno.ENOENT
        info = await c.stat("/etc/outside-link")
        assert info.type == "symlink" and info.target == "../../../../lib/modules/order"
        await c.run(["ln", "-s", "/../../..", "/tmp/up"])
        assert (await c.read("/tmp/up/etc/passwd")) == passwd
        await c.write("/tmp/up/tmp/through-link", b"x")  # lands in the sandbox's /tmp
        out, _, _ = await c.run(["cat", "/tmp/through-link"])
        assert out == b"x"
        for path in ("/proc/1/environ", "/dev/null", "/sys/kernel/notes"):
            with pytest.raises(FileAccessError) as ei:
                await c.read(path)
            assert ei.value.errno == errno.EXDEV, path
        with pytest.raises(FileAccessError):
            await c.remove("/")
        await c.remove("/tmp/up")
        await c.remove("/tmp/through-link")

    vm.run(go())


def test_identity_and_sync(vm: VM) -> None:
    mid = os.urandom(16).hex()
    now = time.time_ns()
    vm.run(vm.c.identity("sb-vmtest", mid, os.urandom(64), now + 3600 * 10**9))
    out, _, _ = vm.sh("hostname; cat /etc/hostname /etc/machine-id /etc/hosts; date +%s")
    lines = out.splitlines()
    assert lines[:3] == ["sb-vmtest", "sb-vmtest", mid]
    assert "127.0.0.1\tlocalhost" in lines and "127.0.1.1\tsb-vmtest" in lines
    assert abs(int(lines[-1]) - (now // 10**9 + 3600)) < 30
    vm.run(vm.c.sync())
    vm.run(vm.c.sync(freeze=True))
    vm.run(vm.c.sync(freeze=False))
    assert vm.sh("echo ok > /tmp/after-thaw && cat /tmp/after-thaw")[0] == "ok\n"


def test_fork_bomb_is_bounded(vm: VM) -> None:
    async def go() -> None:
        bomb = await vm.c.exec(["sh", "-c", "b() { b | b & }; b"])
        await asyncio.sleep(2)
        assert await vm.c.ping(timeout=10) < 5
        await bomb.signal(signal.SIGKILL)
        await bomb.wait(timeout=20)
        out, _, _ = await vm.c.run(["echo", "alive"])
        assert out == b"alive\n"

    vm.run(go(), timeout=60)


# ----------------------------------------------------------- reconnecting ----


def test_reconnect_and_disconnect_mid_stream(vm: VM) -> None:
    async def start_stream() -> int:
        proc = await vm.c.exec(["sh", "-c", "yes | head -c 200000000"])
        async for _ in proc.output():
            break
        return proc.pid

    vm.run(start_stream())
    vm.reconnect()
    hello = vm.run(vm.c.hello(10))
    assert hello.version == 1
    vm.run(vm.c.ping())
    out, _, _ = vm.sh("pkill yes; echo back")
    assert out == "back\n"
    vm.reconnect()
    vm.run(vm.c.hello(10))
    assert vm.sh("echo again")[0] == "again\n"


def test_poweroff(vm: VM) -> None:  # last: the module's VM ends here
    vm.run(vm.c.poweroff())
    assert vm.proc is not None
    assert vm.proc.wait(timeout=20) == 0
    with pytest.raises(HostError):
        vm.run(vm.c.ping())
