"""The gVisor backend with real runsc (systrap) and real EROFS layers.

Every test drives ``GVisorBackend`` through the protocol the edge uses. The module
skips, saying why, when runsc is not installed (scripts/setup.sh installs it from
bookworm-backports) or the host cannot run sandboxes. At the end, the backend must
have left nothing: no runsc container, mount, cgroup, bundle directory or record.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import _TRAIL, RT_PREFIX, mountinfo_lines, wait_until
from dsec.errors import ExecError, ExecTimeout, FileAccessError, SandboxStateError, Unsupported

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(shutil.which("runsc") is None,
                       reason="runsc is not installed (scripts/setup.sh installs it from bookworm-backports)"),
]

MiB = 1 << 20
# A process tree whose members ignore SIGTERM, hide in subshells and orphan themselves.
TREE = (
    "sh -c 'trap \"\" TERM; sleep 1001' & "
    "(trap '' TERM; sleep 1002 & wait) & "
    "(sh -c 'trap \"\" TERM HUP; sleep 1003' &) ; "
    "setsid sh -c 'sleep 1005' & "  # out of the session and group (not orphaned: still a descendant)
    "echo started; sleep 1000"
)


class GVHarness:
    """A started GVisorBackend with its own event loop, driven from sync tests."""

    def __init__(self, name: str, base: Path, seed: Path, probe: Path | None) -> None:
        from dsec.backends.gvisor.backend import GVisorBackend
        from dsec.backends.gvisor.config import GVisorConfig
        from dsec.images import LocalLayerStore

        self.name = name
        self.base = base
        self.state_dir = base / f"state-{name}"
        self.run_dir = base / "run"
        self.probe_binary = probe
        self.store = LocalLayerStore(self.state_dir / "layers")
        self.store.add_erofs(seed, name="busybox", tag="test", kind="base")
        self.config = GVisorConfig(uppers_image_size=1 << 30)
        self.runner = asyncio.Runner()
        self.b = GVisorBackend(self.config, name=name, state_dir=self.state_dir, run_dir=self.run_dir,
                               id_prefix="gv", store=self.store)

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return self.runner.run(asyncio.wait_for(coro, timeout))

    def spec(self, **res: Any) -> Any:
        from dsec.spec import ImageRef, Resources, SandboxSpec

        extra = {k: res.pop(k) for k in ("env", "output_cap", "network") if k in res}
        res.setdefault("disk_medium", "memory")
        return SandboxSpec(image=ImageRef(base="busybox:test"), backend="gvisor", resources=Resources(**res), **extra)

    def create(self, **kw: Any) -> Any:
        rec = self.run(self.b.create(self.spec(**kw)))
        _TRAIL.append((self, rec.id))
        return rec

    @contextlib.contextmanager
    def sandbox(self, **kw: Any) -> Iterator[Any]:
        rec = self.create(**kw)
        try:
            yield rec
        finally:
            self.run(self.b.destroy(rec.id))

    def sh(self, sid: str, cmd: str | list[str], **kw: Any) -> Any:
        kw.setdefault("timeout", 60)
        return self.run(self.b.exec(sid, cmd, **kw))

    def ok(self, sid: str, cmd: str | list[str], **kw: Any) -> str:
        r = self.sh(sid, cmd, **kw)
        assert r.exit_code == 0, f"{cmd!r} in {sid}: exit={r.exit_code} signal={r.signal} stderr={r.stderr!r}"
        return str(r.stdout.decode())

    # -- what the host holds for a sandbox --

    def holdings(self, sid: str) -> list[str]:
        """Every host resource of one sandbox that still exists."""
        cid = self.b.container_id(sid)
        out = [f"mount {ln.split()[4]}" for ln in mountinfo_lines() if f"/sb/{sid}/" in ln.split()[4] + "/"]
        out += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob(f"*/dsec/{self.name}/{sid}")]
        out += [f"runsc state {p}" for p in self.b.runsc_root.glob(f"*{cid}*")] if self.b.runsc_root.exists() else []
        out += [f"bundle {p}" for p in [self.b.bundle_dir(sid)] if p.exists()]
        out += [f"record {p}" for p in [self.b.records_dir / f"{sid}.json"] if p.exists()]
        out += [f"process {pid} holds its mounts" for pid in _pids_with_mount(f"/sb/{sid}/")]
        return out

    def job_cgroups(self, sid: str) -> list[str]:
        """The commands' cgroups inside the sandbox (gVisor's job hierarchy), listed by a
        privileged exec that mounts the hierarchy in a mount namespace of its own."""
        script = ("mount --make-rprivate / && mount -t cgroup -o job none /sys/fs/cgroup && "
                  "find /sys/fs/cgroup/dsec -mindepth 1 -maxdepth 1 -type d")
        out = self.run(self.b.runsc.call("exec", "--user=0:0", "--cap=CAP_SYS_ADMIN", self.b.container_id(sid),
                                         "/bin/unshare", "-m", "/bin/sh", "-c", script))
        return out.decode().split()

    def trail(self, sid: str) -> str:
        rec = self.b.sandboxes.get(sid)
        lines = [f"gvisor sandbox {sid} (backend {self.name})"]
        if rec is None:
            lines.append("  not in the backend any more (destroyed or never made)")
        else:
            lines.append(f"  state={rec.state.value} reason={rec.reason!r} sentry={rec.sandbox_pid} "
                         f"usage={self.b.usage(sid)}")
            lines += [f"  event {json.dumps(ev, default=str)}" for ev in rec.events[-20:]]
        lines.append(f"  host holdings={self.holdings(sid)}")
        return "\n".join(lines)

    def leftovers(self) -> list[str]:
        left = [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob(f"*/dsec/{self.name}")]
        left += [f"mount {ln.split()[4]}" for ln in mountinfo_lines()
                 if ln.split()[4].startswith(str(self.b.run_dir) + "/")]
        left += [f"record {p}" for p in self.b.records_dir.glob("*.json")]
        left += [f"run dir {self.b.run_dir}"] if self.b.run_dir.exists() else []
        left += [f"runsc process {pid}" for pid in _runsc_processes(self.b.runsc_root)]
        return left

    def close(self) -> None:
        try:
            self.run(self.b.close())
        finally:
            self.runner.close()


def _pids_with_mount(fragment: str) -> list[int]:
    """Processes in other mount namespaces than ours (runsc's sentries and gofers) that still
    hold a mount whose path contains ``fragment``."""
    ours = os.readlink("/proc/self/ns/mnt")
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{p}/ns/mnt") != ours and fragment in Path(f"/proc/{p}/mountinfo").read_text():
                out.append(int(p))
    return out


def _runsc_processes(root: Path) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{p}/cmdline").read_bytes()
                if f"--root={root}".encode() in cmd:
                    out.append(int(p))
    return out


@pytest.fixture(scope="module")
def gv(dsec_base: Path, busybox_seed: Path, probe_binary: Path | None) -> Iterator[GVHarness]:
    h = GVHarness(f"{RT_PREFIX}-gv", dsec_base, busybox_seed, probe_binary)
    h.run(h.b.start())
    try:
        yield h
    finally:
        h.close()
    left = h.leftovers()
    assert not left, f"gvisor backend {h.name} left after close(): {left}"


@pytest.fixture
def sb(gv: GVHarness) -> Iterator[Any]:
    with gv.sandbox() as rec:
        yield rec


# ----------------------------------------------------------------- exec ----


def test_exec_results_env_cwd_user_stdin(gv: GVHarness, sb: Any) -> None:
    r = gv.sh(sb.id, "echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.signal, r.stdout, r.stderr) == (3, None, b"out\n", b"err\n")
    # The helper tells a signal from an exit status (runsc exec alone says 143 for both).
    r = gv.sh(sb.id, "kill -TERM $$")
    assert (r.exit_code, r.signal) == (None, signal.SIGTERM)
    r = gv.sh(sb.id, "exit 143")
    assert (r.exit_code, r.signal) == (143, None)
    r = gv.sh(sb.id, ["printf", "%s|", "a b", "'c'", "$HOME", "*"])
    assert r.stdout == b"a b|'c'|$HOME|*|"
    assert gv.sh(sb.id, "printf '\\000\\001\\377'").stdout == b"\x00\x01\xff"
    out = gv.ok(sb.id, "echo $FOO $HOME; pwd; id -u; id -g; cat", env={"FOO": "bar"}, cwd="/tmp",
                user="1000:1001", stdin=b"from stdin\n")
    assert out == "bar /root\n/tmp\n1000\n1001\nfrom stdin\n"
    assert gv.ok(sb.id, "id -u", user="root") == "0\n"
    # Large stdin goes through while output streams back.
    data = os.urandom(3 * MiB)
    r = gv.sh(sb.id, "wc -c", stdin=data)
    assert r.stdout.strip() == str(len(data)).encode()
    with pytest.raises(ExecError) as ei:
        gv.sh(sb.id, ["/no/such/binary"])
    assert ei.value.fields.get("stage") == "exec"
    with pytest.raises(ExecError) as ei:
        gv.sh(sb.id, "true", cwd="/no/such/dir")
    assert ei.value.fields.get("stage") == "cwd"
    # A ulimit in one command does not bind the next (runsc shares one limit set between execs).
    gv.ok(sb.id, "ulimit -n 64; ulimit -n")
    assert gv.ok(sb.id, "ulimit -n") == f"{sb.spec.resources.nofile}\n"


def test_output_cap_and_streaming(gv: GVHarness) -> None:
    with gv.sandbox(output_cap=4096) as rec:
        chunks: list[tuple[str, bytes]] = []
        r = gv.sh(rec.id, "seq 1 100000; echo tail-end", on_output=lambda s, c: chunks.append((s, c)))
        assert r.truncated and r.limit is not None and r.limit.kind == "output_cap"
        assert r.stdout.startswith(b"1\n2\n3\n") and r.stdout.endswith(b"tail-end\n") and b"omitted" in r.stdout
        assert r.stdout_bytes == len(b"".join(c for s, c in chunks if s == "stdout")) > 500_000


def test_timeout_kills_the_whole_tree_not_the_sandbox(gv: GVHarness, sb: Any) -> None:
    t0 = time.monotonic()
    with pytest.raises(ExecTimeout) as ei:
        gv.sh(sb.id, TREE, timeout=1.0)
    assert time.monotonic() - t0 < 8
    err = ei.value
    assert err.fields["reason"] == "timeout" and err.result.timed_out == "timeout"
    assert err.result.stdout == b"started\n" and err.result.signal == signal.SIGKILL
    ps = gv.ok(sb.id, "ps -o pid,args")
    assert "sleep 100" not in ps, ps
    assert err.result.limit is not None and err.result.limit.kind == "timeout"
    with pytest.raises(ExecTimeout):
        gv.sh(sb.id, "sleep 1; echo hi; sleep 100", timeout=30, idle_timeout=0.5)
    assert gv.ok(sb.id, "echo alive") == "alive\n"


def test_a_timeout_kills_what_left_the_session_and_was_orphaned(gv: GVHarness, sb: Any) -> None:
    """Every command runs in a cgroup of its own inside the sandbox (gVisor's job hierarchy):
    what it starts stays there however it detaches. Here setsid and double forks, orphaned to
    pid 1 and out of the command's session and group, for root as for another user."""
    tree = ("(setsid sh -c 'sleep {0} & exec sleep {1}' &) ; "
            "(setsid sh -c '(sleep {2} &) ; (setsid sleep {3} &)' &) ; "
            "setsid sleep {4} & echo started; sleep 1000")
    for user, base in (("root", 2100), ("1000:1000", 2200)):
        sleeps = [f"sleep {base + i}" for i in range(5)]
        with pytest.raises(ExecTimeout) as ei:
            gv.sh(sb.id, tree.format(*range(base, base + 5)), user=user, timeout=1.5)
        assert ei.value.result.stdout == b"started\n" and ei.value.result.signal == signal.SIGKILL, ei.value.result
        ps = gv.ok(sb.id, "ps -o args")
        assert not [s for s in sleeps if s in ps], f"{user}: left in the sandbox:\n{ps}"
    assert gv.job_cgroups(sb.id) == []
    # The command cannot see, mount or leave its cgroup, root included, and never has CAP_SYS_ADMIN
    # (the helper drops it): root has the container's set (Docker's default minus NET_RAW and
    # MKNOD, 0xa00405fb), other users none.
    probe = ("grep job /proc/self/cgroup; grep -E 'CapEff|CapBnd' /proc/self/status; ls /sys/fs/cgroup | wc -l; "
             "mount -t cgroup -o job none /tmp >/dev/null 2>&1 && echo mounted || echo refused")
    out = gv.ok(sb.id, probe, user="root").split()
    assert out[0].startswith("5:job:/dsec/") and out[1:] == ["CapEff:", "00000000a00405fb", "CapBnd:",
                                                             "00000000a00405fb", "0", "refused"], out
    out = gv.ok(sb.id, probe, user="1000").split()
    assert out[0].startswith("5:job:/dsec/") and out[1:] == ["CapEff:", "0000000000000000", "CapBnd:",
                                                             "00000000a00405fb", "0", "refused"], out
    # The helper blocks what a command may send its own group (`kill 0`); the command inherits none of it.
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGPIPE, signal.SIGUSR1, signal.SIGALRM):
        r = gv.sh(sb.id, f"kill -{sig.name[3:]} $$; sleep 5", user="1000", timeout=10)
        assert (r.exit_code, r.signal) == (None, sig), (sig, r)
    # A background job keeps its command's cgroup; once it has ended, the next command removes it.
    gv.ok(sb.id, "sleep 0.5 >/dev/null 2>&1 &")
    assert len(gv.job_cgroups(sb.id)) == 1
    time.sleep(1.0)
    gv.ok(sb.id, "true")
    assert gv.job_cgroups(sb.id) == []


# ------------------------------------------------ commands under attack ----
# Issue 22: in gVisor 20240729 a command could unshare a user namespace, gain every capability
# over a mount namespace it owned, mount the sentry's cgroupfs there and move itself out of
# its cgroup; a root command could also kill or stop pid 1 and its own helper. Commands now
# run under a seccomp filter dsec-gvexec installs right before execve, and are killed by their
# own UTS namespace, which nothing under that filter can leave.


@pytest.fixture(scope="module")
def gvabuse(dsec_base: Path) -> Path:
    from dsec.bench.abuse_gvisor import build_gvabuse

    built = build_gvabuse(dsec_base / "gvabuse")
    if built is None:
        pytest.skip("the static attack program could not be built (gcc -static)")
    return built


def _attack(gv: GVHarness, sid: str, gvabuse: Path) -> str:
    from dsec.bench.abuse_gvisor import GVABUSE_PATH

    gv.b.files(sid).write(GVABUSE_PATH, gvabuse.read_bytes(), mode=0o755)
    return GVABUSE_PATH


def _ops(gv: GVHarness, sid: str, prog: str, ops: list[str], user: str) -> dict[str, tuple[int, str]]:
    from dsec.bench.abuse_gvisor import parse_ops

    r = gv.sh(sid, [prog, *ops], user=user)
    got = parse_ops(r.stdout.decode(), ops)
    assert set(got) == set(ops), r  # every op ran and said how it ended
    return got


def test_a_user_namespace_does_not_take_a_command_out_of_its_cgroup(gv: GVHarness, sb: Any, gvabuse: Path) -> None:
    """unshare(CLONE_NEWUSER), mount the sentry's cgroupfs in a mount namespace it owns, write its
    pid to the root cgroup.procs, setsid and double fork, then run past the timeout. Before the
    fix root's sleeper outlived the timeout every time (uid 1000's write got EACCES)."""
    prog = _attack(gv, sb.id, gvabuse)
    for user, marker in (("root", "3201"), ("1000:1000", "3202")):
        with pytest.raises(ExecTimeout) as ei:
            gv.sh(sb.id, [prog, f"cgroup_escape={marker}", "pause"], user=user, timeout=2.0)
        out = ei.value.result.stdout.decode()
        assert "detached" in out.split("\n"), out  # the attack ran to its end either way
        ps = gv.ok(sb.id, "ps -o pid,stat,user,args")
        assert f"sleep {marker}" not in ps, f"{user}: outlived its timeout\n{out}\n{ps}"
        assert "step move_to_root 0 OK" not in out, out
    assert gv.job_cgroups(sb.id) == []


def test_commands_cannot_make_or_enter_namespaces_or_mount(gv: GVHarness, sb: Any, gvabuse: Path) -> None:
    prog = _attack(gv, sb.id, gvabuse)
    refused = ["unshare_user", "unshare_mnt", "unshare_pid", "unshare_net", "unshare_uts", "unshare_cgroup",
               "clone_newuser", "clone_newns", "clone_newpid", "setns_net", "setns_init_mnt", "setns_parent_mnt",
               "mount_cgroup", "mount_tmpfs", "umount_proc", "fsopen", "open_tree"]
    for user in ("root", "1000"):
        got = _ops(gv, sb.id, prog, [*refused, "clone3_newuser", "clone3_plain", "fork", "clone_plain"], user)
        assert {o: got[o] for o in refused} == dict.fromkeys(refused, (-1, "EPERM")), (user, got)
        # clone3's flags are in memory a filter cannot read: ENOSYS, and libc falls back to clone
        assert got["clone3_newuser"] == got["clone3_plain"] == (-1, "ENOSYS"), (user, got)
        assert got["fork"][0] > 0 and got["clone_plain"][0] > 0, (user, got)
        assert "Seccomp:\t2" in gv.ok(sb.id, "grep Seccomp /proc/self/status", user=user)
    # A command's own children are under the filter too (inherited across fork and execve).
    r = gv.sh(sb.id, "sh -c 'unshare -U true' && echo unshared; true")
    assert b"unshared" not in r.stdout, r


def test_a_root_command_that_races_into_another_cgroup_is_still_killed(gv: GVHarness, sb: Any,
                                                                         gvabuse: Path) -> None:
    """gVisor lets root reopen another process's /proc/<pid>/fd links: a root command spinning
    on them while other commands start moves into a cgroup a helper held open for a moment
    (measured: within 3-100 starts). It is still killed at its timeout: kill goes by the
    command's UTS namespace. Before, it lived on whenever the race was won (not every run)."""
    prog = _attack(gv, sb.id, gvabuse)

    async def race() -> tuple[Any, int]:
        attack = asyncio.ensure_future(gv.b.exec(sb.id, [prog, "fd_race=4:3211", "pause"], timeout=5.0))
        starts = 0
        while not attack.done():
            await gv.b.exec(sb.id, ["true"])
            starts += 1
        with contextlib.suppress(ExecTimeout):
            await attack
        return attack, starts

    attack, starts = gv.run(race())
    assert starts > 0 and isinstance(attack.exception(), ExecTimeout), attack
    out = attack.exception().result.stdout.decode()
    ps = gv.ok(sb.id, "ps -o pid,stat,user,args")
    assert "sleep 3211" not in ps, f"outlived its timeout ({'moved' if 'moved via' in out else 'never moved'})\n{out}\n{ps}"
    assert gv.job_cgroups(sb.id) == []


def test_a_command_that_stops_or_kills_its_helper_is_still_ended(gv: GVHarness, sb: Any) -> None:
    """The helper reports a command's end; root may signal it. A stopped helper is continued by
    the timeout's kill and reports; a killed one gets its command killed before the end is
    reported (before: the first stayed stopped for good, the second's command ran on)."""
    with pytest.raises(ExecTimeout):
        gv.sh(sb.id, "kill -STOP $PPID; (setsid sleep 3221 >/dev/null 2>&1 &) ; sleep 3222", timeout=1.5)
    r = gv.sh(sb.id, "kill -KILL $PPID; (setsid sleep 3223 >/dev/null 2>&1 &) ; sleep 3224", timeout=30)
    assert r.timed_out is None, r
    ps = gv.ok(sb.id, "ps -o pid,stat,user,args")
    assert not [ln for ln in ps.splitlines() if "sleep 322" in ln], ps
    assert not [ln for ln in ps.splitlines() if "dsec-gvexec run" in ln and ln.split()[1].startswith("T")], ps
    assert gv.job_cgroups(sb.id) == []
    # Other users cannot signal a helper (root's) at all.
    assert gv.ok(sb.id, "kill -STOP $PPID 2>/dev/null; kill -KILL $PPID 2>/dev/null; echo here", user="1000") == "here\n"


def test_no_command_can_kill_or_stop_pid_1(gv: GVHarness, gvabuse: Path) -> None:
    """gVisor delivers SIGKILL and SIGSTOP to a pid namespace's init from inside it: before, a
    root `kill -9 1` ended the whole sandbox, and SIGIO redirected to pid 1 with F_SETSIG did too."""
    with gv.sandbox() as rec:
        prog = _attack(gv, rec.id, gvabuse)
        ops = ["kill=1:9", "kill=1:19", "tkill_init", "tgkill_init", "sigqueue_init", "pidfd_kill_init",
               "sigio_init=9", "sigio_init=19"]
        assert _ops(gv, rec.id, prog, ops, "root") == dict.fromkeys(ops, (-1, "EPERM"))
        gv.sh(rec.id, "kill -9 1; kill -STOP 1; true")
        assert gv.b.get(rec.id).state.value == "running"
        init = [ln for ln in gv.ok(rec.id, "ps -o pid,stat,args").splitlines() if ln.split()[0] == "1"]
        assert init and init[0].split()[1] == "S", init
        assert gv.ok(rec.id, "echo alive") == "alive\n"


def test_sessions_keep_state_and_survive_a_timeout(gv: GVHarness, sb: Any) -> None:
    sess = gv.run(gv.b.open_session(sb.id))
    try:
        assert gv.run(sess.run("cd /tmp && X=42")).exit_code == 0
        assert gv.run(sess.run("echo $X; pwd")).stdout == b"42\n/tmp\n"
        with pytest.raises(ExecTimeout):
            gv.run(sess.run("sleep 100 & sleep 200", timeout=1))
        r = gv.run(sess.run("echo $X; ps -o args | grep -c '^sleep [12]00' || true"))
        assert r.stdout == b"42\n0\n"
    finally:
        gv.run(sess.close())


# ---------------------------------------------------------------- files ----


def test_files_share_the_upper_and_stay_inside(gv: GVHarness, sb: Any) -> None:
    files = gv.b.files(sb.id)
    files.write("/root/from-host.txt", b"host data\n")
    assert gv.ok(sb.id, "cat /root/from-host.txt") == "host data\n"
    gv.ok(sb.id, "echo sandbox data > /tmp/from-sandbox.txt; mkdir -p /work/d && echo x > /work/d/f")
    assert files.read("/tmp/from-sandbox.txt") == b"sandbox data\n"
    assert {f.name for f in files.list("/work/d")} == {"f"}
    # Writes land in our upper (runsc --overlay2=none): /tmp too (not runsc's own tmpfs).
    upper = gv.b.bundle_dir(sb.id) / "upper" / "upper"
    assert (upper / "tmp" / "from-sandbox.txt").read_bytes() == b"sandbox data\n"
    assert (upper / "work" / "d" / "f").exists()
    # An edit from the host after the sandbox read the file is seen (shared file access).
    gv.ok(sb.id, "cat /root/from-host.txt")
    files.write("/root/from-host.txt", b"host data, longer now\n")
    gv.ok(sb.id, "echo appended >> /root/from-host.txt")
    assert files.read("/root/from-host.txt") == b"host data, longer now\nappended\n"
    # Traversal: ".." and absolute symlinks resolve inside the sandbox's root.
    gv.ok(sb.id, "echo sandbox-passwd > /tmp/passwd; ln -s / /tmp/root-link; ln -s ../../../../etc /tmp/up")
    host_passwd = Path("/etc/passwd").read_bytes()
    assert files.read("/../../../etc/passwd") != host_passwd
    assert files.read("/tmp/root-link/tmp/passwd") == b"sandbox-passwd\n"
    assert files.read("/tmp/up/passwd") == files.read("/etc/passwd") != host_passwd
    files.write("/../../../../tmp/escape.txt", b"x")
    assert gv.ok(sb.id, "cat /tmp/escape.txt") == "x"
    assert not Path("/tmp/escape.txt").exists() or Path("/tmp/escape.txt").read_bytes() != b"x"
    with pytest.raises(FileAccessError):
        files.read("/proc/self/environ")


# --------------------------------------------------------------- limits ----


def _probe(gv: GVHarness, sid: str) -> str:
    if gv.probe_binary is None:
        pytest.skip("the static probe could not be built (gcc -static)")
    gv.b.files(sid).write("/usr/bin/dsec-probe", gv.probe_binary.read_bytes(), mode=0o755)
    return "/usr/bin/dsec-probe"


def test_memory_limit_binds_and_is_reported(gv: GVHarness) -> None:
    with gv.sandbox(memory=96 * MiB) as rec:
        probe = _probe(gv, rec.id)
        assert gv.ok(rec.id, [probe, "alloc=16"]) == "alloc=16 0 OK\n"
        oom0 = gv.b.cgroups.oom_kills(rec.id)
        r = gv.sh(rec.id, [probe, "alloc=400"])
        # gVisor has no OOM kill of its own: the host's OOM killer acts in the sandbox's memory
        # cgroup. It usually ends the systrap stub of the process that grew (the process dies,
        # the sandbox lives), or, when the sentry itself holds the memory, the sentry (the
        # sandbox is failed). Either way the command fails and the verdict is "memory".
        assert r.exit_code != 0 and r.stdout == b"", r
        assert r.limit is not None and r.limit.kind == "memory", r
        assert gv.b.cgroups.oom_kills(rec.id) > oom0
        state = gv.b.get(rec.id).state.value
        if state == "running":
            assert gv.ok(rec.id, "echo alive") == "alive\n"
        else:
            assert state == "failed" and "memory limit" in gv.b.get(rec.id).reason
            with pytest.raises(SandboxStateError):
                gv.sh(rec.id, "true")


def test_pids_and_cpu_limits_bind(gv: GVHarness) -> None:
    with gv.sandbox(pids=16, cpu=0.5) as rec:
        # The sandbox's processes are counted inside gVisor (RLIMIT_NPROC = pids, which root
        # cannot raise: no CAP_SYS_RESOURCE); the host's pids cgroup only bounds the sentry.
        assert gv.ok(rec.id, "ulimit -u; ulimit -Hu") == "16\n16\n"
        r = gv.sh(rec.id, "for i in $(seq 1 40); do sleep 2 & done; echo never")
        assert r.exit_code != 0 and b"can't fork" in r.stderr and b"never" not in r.stdout, r
        assert r.limit is not None and (r.limit.kind, r.limit.value) == ("pids", 16), r
        # At the limit nothing more starts; once the sleeps end, the sandbox works again.
        def works() -> bool:
            try:
                return bool(gv.sh(rec.id, "echo survives").stdout == b"survives\n")
            except ExecError:  # the helper itself could not fork
                return False

        assert wait_until(works, timeout=10, interval=0.5)
        assert gv.b.get(rec.id).state.value == "running"
        c0, t0 = gv.b.cgroups.cpu_s(rec.id), time.monotonic()
        gv.sh(rec.id, "timeout 2 sh -c 'while :; do :; done'; true")
        used, wall = gv.b.cgroups.cpu_s(rec.id) - c0, time.monotonic() - t0
        assert used < 0.5 * wall * 1.25, (used, wall)  # half a core, whatever the host has


def test_disk_quota_on_both_media(gv: GVHarness) -> None:
    with gv.sandbox(disk=8 * MiB) as rec:
        r = gv.sh(rec.id, "dd if=/dev/zero of=/root/big bs=1M count=20")
        assert r.exit_code != 0 and b"No space left" in r.stderr
        assert r.limit is not None and r.limit.kind == "disk_full"
        gv.ok(rec.id, "rm /root/big; echo fine > /root/small")
    with gv.sandbox(disk=8 * MiB, disk_medium="disk") as rec:
        r = gv.sh(rec.id, "dd if=/dev/zero of=/root/big bs=1M count=20")
        assert r.exit_code != 0 and b"quota" in r.stderr.lower()
        assert gv.b.usage(rec.id).disk_bytes > 6 * MiB
        sub = gv.b.run_dir / "uppers" / rec.id
        assert (sub / "upper" / "root" / "big").exists()
    assert not (gv.b.run_dir / "uppers" / rec.id).exists()


# ---------------------------------------------------------- pause/resume ----


def test_pause_freezes_and_resume_thaws(gv: GVHarness, sb: Any) -> None:
    gv.ok(sb.id, "(while :; do :; done) >/dev/null 2>&1 &")
    res = gv.run(gv.b.pause(sb.id))
    assert gv.b.get(sb.id).state.value == "paused" and gv.b.cgroups.freezer_state(sb.id) == "FROZEN"
    assert res.freeze_s < 1.0
    c0 = gv.b.cgroups.cpu_s(sb.id)
    time.sleep(0.5)
    assert gv.b.cgroups.cpu_s(sb.id) - c0 < 0.01  # sentry, gofer and the busy loop all stopped
    with pytest.raises(SandboxStateError):
        gv.run(gv.b.pause(sb.id))  # paused -> paused is no move
    gv.run(gv.b.resume(sb.id))
    assert gv.b.get(sb.id).state.value == "running"
    # An exec on a paused sandbox wakes it first.
    gv.run(gv.b.pause(sb.id))
    assert gv.ok(sb.id, "echo awake") == "awake\n"
    with pytest.raises(SandboxStateError):
        gv.run(gv.b.resume(sb.id))  # running -> running is no move either
    out = gv.run(gv.b.pause_many([sb.id, sb.id]))
    assert set(out.done) | set(out.skipped) == {sb.id} and not out.errors
    gv.run(gv.b.resume_many([sb.id]))


# -------------------------------------------------------- destroy/leaks ----


def test_destroy_leaves_nothing(gv: GVHarness) -> None:
    a = gv.create()
    b = gv.create(disk_medium="disk")
    gv.ok(a.id, "echo x > /root/x")
    assert gv.holdings(a.id), "a live sandbox holds host resources"
    # A paused sandbox is destroyed too (its frozen tasks are killed, then thawed).
    gv.run(gv.b.pause(a.id))
    assert gv.run(gv.b.destroy(a.id)) is True
    assert gv.run(gv.b.destroy(a.id)) is False
    # Nothing of a remains, not even in b's sentry and gofer (their namespaces were made
    # while a's overlay was mounted on the host).
    assert wait_until(lambda: not gv.holdings(a.id), timeout=5), gv.holdings(a.id)
    gv.run(gv.b.destroy(b.id))
    assert wait_until(lambda: not gv.holdings(b.id), timeout=5), gv.holdings(b.id)
    assert not _runsc_processes(gv.b.runsc_root)


def test_unsupported_operations_say_so(gv: GVHarness, sb: Any) -> None:
    from dsec.backends.base import Capability, EdgeMeta, TtySize
    from dsec.spec import NetworkPolicy

    caps = gv.b.capabilities
    assert caps.kind == "gvisor"
    assert {Capability.SANDBOXES, Capability.EXEC, Capability.FILES, Capability.PAUSE} <= caps.ops
    assert not {Capability.FORK, Capability.SNAPSHOT, Capability.NETWORK, Capability.STAGES, Capability.PTY} & caps.ops
    for call in (
        gv.b.fork(sb.id, 2, edges=[EdgeMeta(), EdgeMeta()]),
        gv.b.snapshot_info(sb.id),
        gv.b.set_policy(sb.id, NetworkPolicy()),
        gv.b.set_stage(sb.id, "x"),
        gv.b.start_tty(sb.id, ["sh"], size=TtySize()),
        gv.b.exec(sb.id, "true", pristine=["/etc"]),
    ):
        with pytest.raises(Unsupported) as ei:
            gv.run(call)
        assert ei.value.fields.get("backend") == "gvisor"
    with pytest.raises(Unsupported):
        gv.run(gv.b.create(gv.spec(network=NetworkPolicy(allow=("pypi",)))))
    from dsec.errors import InvalidSpec

    with pytest.raises(InvalidSpec) as bad:
        gv.run(gv.b.create(gv.spec().model_copy(update={"backend": "container"})))
    assert bad.value.fields.get("field") == "backend"
    for kw in ({"idle_timeout": 0}, {"output_cap": -5}, {"timeout": -1}):
        with pytest.raises(InvalidSpec):
            gv.run(gv.b.exec(sb.id, "echo ran", **kw))
    # With file_access="exclusive" the sentry caches as if alone: no host-side files then.
    from dsec.backends.gvisor.backend import GVisorBackend
    from dsec.backends.gvisor.config import GVisorConfig

    fast = GVisorBackend(GVisorConfig(file_access="exclusive"), name=f"{gv.name}x", state_dir=gv.state_dir,
                         run_dir=gv.run_dir, store=gv.store)
    assert Capability.FILES not in fast.capabilities.ops
    with pytest.raises(Unsupported):
        fast.files(sb.id)


# ------------------------------------------------------------ reconcile ----

_CRASHER = textwrap.dedent("""
    import asyncio, json, sys
    from pathlib import Path
    from dsec.backends.gvisor.backend import GVisorBackend
    from dsec.backends.gvisor.config import GVisorConfig
    from dsec.images import LocalLayerStore
    from dsec.spec import ImageRef, Resources, SandboxSpec

    name, state, run = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])

    def spec(**res):
        return SandboxSpec(image=ImageRef(base="busybox:test"), backend="gvisor",
                           resources=Resources(disk_medium="memory", **res))

    async def main():
        b = GVisorBackend(GVisorConfig(uppers_image_size=1 << 30), name=name, state_dir=state, run_dir=run,
                          id_prefix="gv", store=LocalLayerStore(state / "layers"))
        await b.start()
        keep = await b.create(spec())
        await b.exec(keep.id, "echo before-crash > /root/mark")
        dead = await b.create(spec())
        paused = await b.create(spec())
        await b.pause(paused.id)
        run_call = b.runsc.call

        async def stuck(*args, **kw):
            if "run" in args:  # the runsc container of "half" is never made
                print(json.dumps({"keep": keep.id, "dead": dead.id, "dead_pid": dead.sandbox_pid,
                                  "paused": paused.id, "half": "gv-half"}), flush=True)
                await asyncio.sleep(3600)
            return await run_call(*args, **kw)

        b.runsc.call = stuck
        await b.create(spec(), sandbox_id="gv-half")

    asyncio.run(main())
""")


def test_reconcile_after_sigkill(gv: GVHarness, dsec_base: Path, busybox_seed: Path) -> None:
    from dsec.backends.gvisor.backend import GVisorBackend

    name = f"{RT_PREFIX}-gvr"
    state = dsec_base / f"state-{name}"
    from dsec.images import LocalLayerStore

    LocalLayerStore(state / "layers").add_erofs(busybox_seed, name="busybox", tag="test", kind="base")
    proc = subprocess.Popen([sys.executable, "-c", _CRASHER, name, str(state), str(dsec_base / "run")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    from dsec.backends.gvisor.config import GVisorConfig

    h = GVHarness.__new__(GVHarness)
    h.name, h.runner, h.run_dir = name, asyncio.Runner(), dsec_base / "run"
    h.b = GVisorBackend(GVisorConfig(uppers_image_size=1 << 30), name=name, state_dir=state,
                        run_dir=dsec_base / "run", id_prefix="gv", store=LocalLayerStore(state / "layers"))
    try:
        assert line, "the crashing process did not get its sandboxes up"
        ids = json.loads(line)
        # "dead" dies while no backend runs: its sentry.
        with contextlib.suppress(ProcessLookupError):
            os.kill(ids["dead_pid"], signal.SIGKILL)
        assert wait_until(lambda: not Path(f"/proc/{ids['dead_pid']}/cmdline").exists()
                          or not Path(f"/proc/{ids['dead_pid']}/cmdline").read_bytes(), timeout=5)
        assert (h.run_dir / name / "sb" / "gv-half" / "rootfs").is_dir()  # half made: mounted, no container
        h.run(h.b.start())
        assert sorted(h.b.reconciled["adopted"]) == sorted([ids["keep"], ids["paused"]])
        assert {ids["dead"], ids["half"]} <= set(h.b.reconciled["destroyed"])
        assert h.b.get(ids["paused"]).state.value == "paused"
        assert h.ok(ids["keep"], "cat /root/mark") == "before-crash\n"
        assert h.ok(ids["paused"], "echo woke") == "woke\n"
        for sid in (ids["dead"], ids["half"]):
            assert not h.holdings(sid), h.holdings(sid)
    finally:
        # Whatever happened above, a start (reconcile) and close of this name removes it all.
        with contextlib.suppress(Exception):
            h.run(h.b.start())
        h.run(h.b.close())
        h.runner.close()
    left = GVHarness.leftovers(h)
    assert not left, left
