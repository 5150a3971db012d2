"""Isolation of container sandboxes, checked against the real kernel.

Each test states one property a sandbox's processes (even as root inside)
must not break: host processes, files and other sandboxes are invisible,
sysctls are read-only, root inside is an unprivileged uid outside, the network
is loopback only, the seccomp filter holds, and the runtime's own helper (the
sandbox init) cannot be signalled, traced, read or replaced.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import PROBE_PATH, RuntimeHarness, pid_alive, proc_cmdline, proc_status, wait_until

pytestmark = pytest.mark.root


def _numeric_proc_entries(h: RuntimeHarness, sid: str) -> list[int]:
    out = h.ok(sid, "ls /proc")
    return sorted(int(x) for x in out.split() if x.isdigit())


def _cmdlines_inside(h: RuntimeHarness, sid: str) -> str:
    return h.ok(sid, "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done")


# ------------------------------------------------------------ processes ----


def test_cannot_see_host_processes(rtx: RuntimeHarness, sb) -> None:
    host_marker = subprocess.Popen(["sleep", "31337.25"])  # a host process with a recognisable argv
    try:
        pids = _numeric_proc_entries(rtx, sb.id)
        # init (1), the shell and ls: nothing else exists in the sandbox's pid namespace.
        assert 1 in pids
        assert len(pids) <= 4, pids
        assert max(pids) < 100, pids
        cmdlines = _cmdlines_inside(rtx, sb.id)
        assert "31337.25" not in cmdlines
        assert "pytest" not in cmdlines and "python" not in cmdlines
        ps = rtx.ok(sb.id, "ps -o pid,comm")
        rows = [ln.split() for ln in ps.strip().splitlines()[1:]]
        assert {r[0] for r in rows} <= {str(p) for p in range(1, 100)}, ps
        assert all(r[1] in ("dsec-init", "sh", "ps") for r in rows), ps
        # The host's pid of our own process is not a process inside.
        assert rtx.sh(sb.id, f"test -e /proc/{os.getpid()}/cmdline && grep -q pytest /proc/{os.getpid()}/cmdline").exit_code != 0
    finally:
        host_marker.kill()
        host_marker.wait()


def test_cannot_see_host_files(rtx: RuntimeHarness, sb, dsec_base: Path) -> None:
    marker = Path("/tmp") / f"dsec-host-marker-{os.getpid()}"
    marker.write_text("HOST-ONLY")
    in_base = dsec_base / "host-only-marker"
    in_base.write_text("HOST-ONLY")
    try:
        for p in (marker, in_base, dsec_base, Path("/work"), Path("/etc/debian_version")):
            r = rtx.sh(sb.id, ["test", "-e", str(p)])
            assert r.exit_code == 1, f"{p} is visible inside the sandbox"
        found = rtx.ok(sb.id, "find / -xdev -name 'dsec-host-marker-*' -o -name host-only-marker")
        assert found.strip() == ""
        # The root is the image's, not the host's.
        passwd = rtx.ok(sb.id, "cat /etc/passwd")
        assert passwd.startswith("root:x:0:0:root:/root:/bin/sh\nnobody:")
        assert passwd != Path("/etc/passwd").read_text()
        # No host path shows in the sandbox's mount table.
        mi = rtx.ok(sb.id, "cat /proc/self/mountinfo")
        assert str(dsec_base) not in mi
        assert str(rtx.run_dir) not in mi and str(rtx.state_dir) not in mi
    finally:
        marker.unlink()
        in_base.unlink()


def test_cannot_see_other_sandboxes(rtx: RuntimeHarness) -> None:
    with rtx.sandbox() as a, rtx.sandbox() as b:
        rtx.ok(b.id, "echo secret-of-b > /tmp/secret-b; sleep 4242 >/dev/null 2>&1 &")
        rtx.ok(b.id, "nc -l -p 5555 >/tmp/got </dev/null 2>/dev/null &")
        assert wait_until(lambda: rtx.sh(b.id, "netstat -ltn | grep -q ':5555 '").exit_code == 0)
        # b's file, process and listening port are all invisible to a.
        assert rtx.sh(a.id, "test -e /tmp/secret-b").exit_code == 1
        assert "4242" not in _cmdlines_inside(rtx, a.id)
        assert rtx.sh(a.id, "echo hi | nc -w 1 127.0.0.1 5555").exit_code != 0
        assert rtx.ok(a.id, "netstat -ltn | grep ':5555 ' || true").strip() == ""
        # ...while inside b they are real (the checks above can fail).
        assert rtx.ok(b.id, "cat /tmp/secret-b") == "secret-of-b\n"
        assert "4242" in _cmdlines_inside(rtx, b.id)
        assert rtx.ok(a.id, "hostname").strip() == a.id
        assert rtx.ok(b.id, "hostname").strip() == b.id
        # Different uid ranges, different namespaces.
        assert a.uid_base != b.uid_base
        for ns in ("pid", "mnt", "net", "ipc", "uts", "user", "cgroup"):
            la = os.readlink(f"/proc/{a.init_pid}/ns/{ns}")
            lb = os.readlink(f"/proc/{b.init_pid}/ns/{ns}")
            assert la != lb, f"sandboxes share their {ns} namespace"
            assert la != os.readlink(f"/proc/self/ns/{ns}"), f"sandbox shares the host's {ns} namespace"


# -------------------------------------------------------------- sysctls ----

SYSCTLS = [
    "/proc/sys/vm/swappiness",
    "/proc/sys/kernel/panic",
    "/proc/sys/kernel/pid_max",
    "/proc/sys/fs/file-max",
    "/proc/sys/net/ipv4/ip_forward",
    "/proc/sys/kernel/hostname",
]


def test_cannot_write_sysctls(rtx: RuntimeHarness, sb) -> None:
    for path in SYSCTLS:
        host_before = Path(path).read_text()
        inside_before = rtx.ok(sb.id, ["cat", path])
        r = rtx.sh(sb.id, f"echo 7 > {path}")
        assert r.exit_code != 0, f"writing {path} inside succeeded"
        assert b"Read-only file system" in r.stderr or b"Permission denied" in r.stderr, r.stderr
        assert Path(path).read_text() == host_before, f"host {path} changed"
        assert rtx.ok(sb.id, ["cat", path]) == inside_before
    # busybox sysctl -w goes the same way.
    assert rtx.sh(sb.id, "sysctl -w vm.swappiness=3").exit_code != 0
    # Kernel knobs outside /proc/sys are read-only or masked too.
    assert rtx.sh(sb.id, "echo h > /proc/sysrq-trigger").exit_code != 0
    assert rtx.ok(sb.id, "cat /proc/kallsyms /proc/keys /proc/timer_list 2>/dev/null | wc -c").strip() == "0"
    # And the read-only mount cannot be undone.
    assert rtx.sh(sb.id, "mount -o remount,rw /proc/sys").exit_code != 0
    assert rtx.sh(sb.id, "umount /proc/sys").exit_code != 0
    assert rtx.sh(sb.id, "echo 7 > /proc/sys/vm/swappiness").exit_code != 0


# ------------------------------------------------------------------ uids ----


def _host_uids(pid: int) -> tuple[list[int], list[int]]:
    st = proc_status(pid)
    return [int(x) for x in st["Uid"].split()], [int(x) for x in st["Gid"].split()]


def test_root_inside_is_not_root_outside(rtx: RuntimeHarness, sb) -> None:
    ub = sb.uid_base
    assert ub >= 1 << 24
    assert rtx.ok(sb.id, "id -u").strip() == "0"
    assert rtx.ok(sb.id, "cat /proc/self/uid_map").split() == ["0", str(ub), "65536"]
    rtx.ok(sb.id, "sleep 4243 >/dev/null 2>&1 & sleep 4244 >/dev/null 2>&1 &")
    rtx.ok(sb.id, "sleep 4245 >/dev/null 2>&1 &", user=1000)

    def find(arg: str) -> int:
        for pid in rtx.pids(sb.id):
            if proc_cmdline(pid)[-1:] == [arg]:
                return pid
        raise AssertionError(f"no 'sleep {arg}' in the sandbox's cgroup: {rtx.pids(sb.id)}")

    assert wait_until(lambda: all(any(proc_cmdline(p)[-1:] == [a] for p in rtx.pids(sb.id)) for a in ("4243", "4245")))
    uids, gids = _host_uids(find("4243"))
    assert uids == [ub] * 4 and gids == [ub] * 4
    uids, gids = _host_uids(find("4245"))
    assert uids == [ub + 1000] * 4 and gids == [ub + 1000] * 4
    # No process of the sandbox, the init included, is host uid 0, or holds a
    # capability in the host's user namespace.
    for pid in rtx.pids(sb.id):
        uids, gids = _host_uids(pid)
        assert min(uids) >= ub and min(gids) >= ub, (pid, proc_cmdline(pid), uids)
    init_uids, _ = _host_uids(sb.init_pid)
    assert init_uids == [ub] * 4
    assert int(proc_status(sb.init_pid)["CapEff"], 16) == 0

    # Files made inside are owned on the host by the mapped uids.
    rtx.ok(sb.id, "touch /tmp/owned-by-root; mkdir /root/dir")
    rtx.ok(sb.id, "touch /tmp/owned-by-1000", user=1000)
    upper = rtx.rt.upper_path(sb.id)
    assert os.stat(upper / "tmp/owned-by-root").st_uid == ub
    assert os.stat(upper / "root/dir").st_uid == ub
    assert os.stat(upper / "tmp/owned-by-1000").st_uid == ub + 1000
    root = rtx.rt.root_path(sb.id)
    assert os.stat(root / "tmp/owned-by-root").st_uid == ub
    # Files of the image appear owned by root inside (idmapped lowers), not by nobody.
    assert rtx.ok(sb.id, "stat -c %u:%g /etc/passwd /bin/busybox").split() == ["0:0", "0:0"]
    assert os.stat(root / "etc/passwd").st_uid == ub


def test_hostname_is_the_sandbox_id(rtx: RuntimeHarness, sb) -> None:
    assert rtx.ok(sb.id, "hostname").strip() == sb.id
    assert rtx.ok(sb.id, "uname -n").strip() == sb.id
    assert rtx.ok(sb.id, "cat /proc/sys/kernel/hostname").strip() == sb.id
    assert rtx.sh(sb.id, "hostname evil").exit_code != 0
    assert os.uname().nodename != sb.id


# --------------------------------------------------------------- network ----


def test_network_is_loopback_only_and_up(rtx: RuntimeHarness, sb) -> None:
    dev = rtx.ok(sb.id, "cat /proc/net/dev")
    ifaces = [ln.split(":")[0].strip() for ln in dev.splitlines()[2:]]
    assert ifaces == ["lo"], dev
    ifc = rtx.ok(sb.id, "ifconfig -a")
    assert re.findall(r"^(\S+)", ifc, re.M) == ["lo"], ifc
    assert "UP" in ifc and "RUNNING" in ifc and "127.0.0.1" in ifc
    assert rtx.ok(sb.id, "cat /proc/net/route").strip().count("\n") == 0  # header only: no routes out
    # lo works: a listener and a client inside the sandbox talk.
    rtx.ok(sb.id, "nc -l -p 7777 > /tmp/received 2>/dev/null </dev/null &")
    assert wait_until(lambda: rtx.sh(sb.id, "netstat -ltn | grep -q ':7777 '").exit_code == 0)
    rtx.ok(sb.id, "echo over-lo | nc -w 2 127.0.0.1 7777")
    assert wait_until(lambda: rtx.sh(sb.id, "grep -q over-lo /tmp/received").exit_code == 0)
    # Nothing else is reachable.
    r = rtx.sh(sb.id, "echo x | nc -w 1 1.1.1.1 80")
    assert r.exit_code != 0
    assert b"unreachable" in r.stderr.lower() or b"refused" in r.stderr.lower() or r.stderr, r


# --------------------------------------------------------------- seccomp ----

DENIED_EPERM = [
    "mount", "umount", "pivot_root", "fsopen", "open_tree", "unshare_user", "unshare_mnt",
    "unshare_net", "clone_newuser", "clone_newns", "setns", "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd", "kexec_load", "init_module", "finit_module",
    "delete_module", "reboot", "swapon", "clock_settime", "settimeofday", "open_by_handle_at",
    "io_uring_setup", "io_uring_enter", "acct", "syslog", "kcmp", "af_packet", "raw_socket", "netlink_route_raw",
    "tiocsti", "mknod", "kexec_file_load", "name_to_handle_at", "fanotify_init", "process_madvise",
    "get_mempolicy", "set_mempolicy", "quotactl", "swapoff",
]
# mknod is refused by capabilities (no CAP_MKNOD), the rest by the filter (docs/SECURITY.md).


def test_hardening_state_of_sandbox_processes(rtx: RuntimeHarness, sb) -> None:
    st = rtx.ok(sb.id, "cat /proc/self/status")
    fields = dict(ln.split(":\t", 1) for ln in st.splitlines() if ":\t" in ln)
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2"
    cap_eff = int(fields["CapEff"], 16)
    cap_bnd = int(fields["CapBnd"], 16)
    for cap in (21, 16, 19, 17, 25, 27, 24, 12):  # SYS_ADMIN, SYS_MODULE, SYS_PTRACE, SYS_RAWIO, SYS_TIME, MKNOD, SYS_RESOURCE, NET_ADMIN
        assert not cap_eff & (1 << cap) and not cap_bnd & (1 << cap), f"capability {cap} present"
    st1000 = rtx.ok(sb.id, "cat /proc/self/status", user=1000)
    f1000 = dict(ln.split(":\t", 1) for ln in st1000.splitlines() if ":\t" in ln)
    assert int(f1000["CapEff"], 16) == 0 and int(f1000["CapPrm"], 16) == 0


def test_seccomp_denies_what_a_sandbox_never_needs(rtx: RuntimeHarness, sb) -> None:
    # With busybox alone:
    rtx.ok(sb.id, "mkdir -p /tmp/m")
    r = rtx.sh(sb.id, "mount -t tmpfs x /tmp/m")
    assert r.exit_code != 0, r
    assert b"permission denied" in r.stderr.lower() or b"not permitted" in r.stderr.lower(), r
    assert rtx.sh(sb.id, "unshare -U -r true").exit_code != 0
    assert rtx.sh(sb.id, "unshare -n true").exit_code != 0
    assert rtx.sh(sb.id, "nsenter -t 1 -n true").exit_code != 0
    assert rtx.sh(sb.id, "dmesg").exit_code != 0
    assert rtx.sh(sb.id, "swapon /tmp/m").exit_code != 0
    # And syscall by syscall, as root inside (the case where only seccomp stands in the way).
    res = rtx.probe(sb.id, *DENIED_EPERM, "clone3")
    wrong = {op: v for op, v in res.items() if op != "clone3" and v[1] != "EPERM"}
    assert not wrong, f"not denied with EPERM: {wrong}"
    assert res["clone3"] == (-1, "ENOSYS")  # so libc falls back to clone(), whose flags seccomp can see
    # The audit socket answers as a kernel without audit: useradd and passwd carry on (EPERM aborts them).
    assert rtx.probe(sb.id, "netlink_audit")["netlink_audit"] == (-1, "EPROTONOSUPPORT")
    # A non-root user inside gets no further.
    res = rtx.probe(sb.id, "setuid0", "mount", "unshare_user", "keyctl", user=1000)
    assert all(v[0] < 0 for v in res.values()), res
    # System calls of another architecture (i386 via int 0x80) are killed, not let through.
    if rtx.probe_binary is not None:
        r = rtx.sh(sb.id, [PROBE_PATH, "int80_getpid"])
        assert r.signal in (signal.SIGSYS, signal.SIGSEGV) and b"int80_getpid" not in r.stdout, r
    # The classic chroot escape (root keeps CAP_SYS_CHROOT) ends in the sandbox's own root.
    res = rtx.probe(sb.id, f"chroot_escape={rtx.state_dir}")
    assert res[f"chroot_escape={rtx.state_dir}"] == (-1, "ENOENT")


# ------------------------------------------------------- the sandbox init ----


def test_init_cannot_be_signalled_traced_or_read(rtx: RuntimeHarness, sb) -> None:
    init = sb.init_pid
    ops = [
        "ptrace_init", "ptrace_seize_init", "vm_read_init", "pidfd_getfd_init",
        "open_r=/proc/1/mem", "open_r=/proc/1/environ", "open_r=/proc/1/maps",
        "open_r=/proc/1/exe", "open_w=/proc/1/exe", "readlink=/proc/1/root", "readlink=/proc/1/exe",
        "readlink=/proc/1/cwd", "opendir=/proc/1/fd", "readlink=/proc/1/fd/0", "readlink=/proc/1/fd/3",
        "open_r=/proc/1/root/etc/passwd",
    ]
    res = rtx.probe(sb.id, *ops)
    allowed = {op: v for op, v in res.items() if v[0] >= 0 or v[1] not in ("EPERM", "EACCES")}
    assert not allowed, f"root inside reached the init: {allowed}"
    # Signals: root inside may send them, but the init ignores every one it has no handler for.
    res = rtx.probe(sb.id, "kill_init=9", "kill_init=15", "kill_init=2", "kill_init=1", "pidfd_kill_init")
    assert rtx.sh(sb.id, "kill -9 1; kill -TERM 1; kill -STOP 1; kill -SEGV 1").exit_code in (0, 1)
    assert pid_alive(init)
    assert proc_status(init)["State"][0] in "SR", proc_status(init)["State"]
    assert rtx.ok(sb.id, "echo still-here").strip() == "still-here"
    assert rtx.rt.get(sb.id).init_pid == init
    # The init holds no socket, nothing but /dev/null and the upper dir's handle.
    fds = sorted(int(x) for x in os.listdir(f"/proc/{init}/fd"))
    assert fds == [0, 1, 2, 3], fds
    targets = {fd: os.readlink(f"/proc/{init}/fd/{fd}") for fd in fds}
    assert not any(t.startswith(("socket:", "anon_inode:", "pipe:")) for t in targets.values()), targets
    assert all(targets[fd].endswith("/dev/null") for fd in (0, 1, 2)), targets
    # No unix socket exists in the sandbox's network namespace to connect to.
    unix = rtx.ok(sb.id, "cat /proc/net/unix").strip().splitlines()
    assert len(unix) == 1, unix
    # Processes we start hold nothing of ours either: only their stdio.
    fd_targets = rtx.ok(sb.id, "for f in /proc/self/fd/*; do echo $f $(readlink $f); done")
    for line in fd_targets.strip().splitlines():
        parts = line.split()
        fd = int(parts[0].rsplit("/", 1)[1])
        target = parts[1] if len(parts) > 1 else ""
        assert fd <= 2 or target == "" or not target.startswith(("socket:", "anon_inode:")), fd_targets
    # The init's binary cannot be replaced from inside: not reachable, and the
    # host file is not writable through /proc/1/exe (checked above); it stays intact.
    exe = os.readlink(f"/proc/{init}/exe")
    assert exe.endswith("/dsec-init"), exe  # the static init, exec'd: no memory shared with the spawner
    maps = Path(f"/proc/{init}/maps").read_text()
    assert "dsec-spawner" not in maps and ".so" not in maps, maps  # static: no library of the image
