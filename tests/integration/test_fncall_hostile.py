"""FnCall against calls that attack it (issue 22): each finding of the red team as a test that
failed before its fix, on real worker sandboxes of the real container runtime.

A call must never reach the next call of its slot (a leftover thread of a zombie leader), never
wedge or kill the worker its neighbours run on (a kill helper stopped by SIGSTOP, a forged
result frame, a full disk, a tree too deep for the cleaner, a waiting process killed), and its
``memory`` is a real bound (memfds, pipes). The wider red-team suite is ``tests/abuse``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import RuntimeHarness, wait_until
from dsec.backends.fncall.config import FnCallConfig, FnCallImage
from dsec.backends.fncall.pool import FnCallPool
from dsec.backends.fncall.worker import SPARES_PER_SLOT
from dsec.bench import fncall as bench
from dsec.spec import ImageRef, Resources
from dsec.spec.fncall import (
    FnCall,
    FnCallError,
    FnCallOOM,
    FnCallTimeout,
    FnCallWorkerLost,
    FnResult,
)

pytestmark = [pytest.mark.root, pytest.mark.timeout(900)]

MiB = 1 << 20
CACHE = Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec")) / "cache"
IMAGE = ImageRef(base="pyfn:hostile")
SLOTS = 6  # concurrency 4 + spare 2


@pytest.fixture(scope="module")
def py_image(rtx: RuntimeHarness) -> ImageRef:
    bench.python_layer(rtx.rt.store, CACHE, name="pyfn", tag="hostile")
    return IMAGE


@pytest.fixture(scope="module")
def pool(rtx: RuntimeHarness, py_image: ImageRef) -> Iterator[FnCallPool]:
    res = Resources(cpu=2.0, memory=2048 * MiB, pids=2048, disk=96 * MiB, nofile=4096)
    cfg = FnCallConfig(images=(FnCallImage(image=py_image, concurrency=4, spare=2, resources=res),),
                       call_timeout_s=20, answer_grace_s=5)
    p = FnCallPool(cfg, rtx.rt, name="thostile")
    rtx.run(p.start())
    assert all(w.ready for w in p.workers()), [w.reason for w in p.workers()]
    try:
        yield p
    finally:
        rtx.run(p.close())


def run(rtx: RuntimeHarness, pool: FnCallPool, source: str, *args: Any, **opts: Any) -> FnResult:
    return rtx.run(pool.call(IMAGE, source, list(args), **opts), timeout=300)


def many(rtx: RuntimeHarness, pool: FnCallPool, calls: list[FnCall], **opts: Any) -> list[Any]:
    return rtx.run(pool.call_many(IMAGE, calls, **opts), timeout=300)


def one_worker(pool: FnCallPool) -> str:
    (w,) = pool.workers()
    assert w.ready and w.sandbox_id
    return w.sandbox_id


def neighbours_ok(outs: list[Any], n: int) -> None:
    """The neighbour calls ``FnCall(NEIGHBOUR, (i,))`` all came back with their own value."""
    bad = [(i, o) for i, o in enumerate(outs[:n]) if not (isinstance(o, FnResult) and o.value == i * 3)]
    assert not bad, bad


NEIGHBOUR = "import time\ndef main(i):\n    time.sleep(0.05)\n    return i * 3\n"


# ------------------------------------------------ isolation between calls of a slot --

ZOMBIE_LEADER = r'''
import ctypes, os, threading, time
def main():
    pid = os.fork()
    if pid == 0:
        def spy():
            me = os.getuid()
            deadline = time.time() + 15
            while time.time() < deadline:
                time.sleep(0.01)
        for _ in range(2):
            threading.Thread(target=spy).start()
        ctypes.CDLL(None).syscall(60, 0)  # exit(2) of the leader alone, not exit_group
    time.sleep(0.3)
    return pid
'''

VICTIM = r'''
import os
def main():
    me, own = os.getuid(), os.getpid()
    others = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == own:
            continue
        try:
            for tid in os.listdir(f"/proc/{name}/task"):
                with open(f"/proc/{name}/task/{tid}/status") as f:
                    st = f.read()
                uids = [int(x) for x in st.split("\nUid:")[1].split("\n")[0].split()]
                if me in uids:
                    others.append((int(name), int(tid), st.split("\nState:")[1].split("\n")[0].strip()))
        except (OSError, IndexError):
            continue
    return {"uid": me, "others": others}
'''


def test_a_zombie_leaders_threads_never_meet_the_next_call_of_their_uid(rtx: RuntimeHarness,
                                                                         pool: FnCallPool) -> None:
    """The leader of a child ends with the raw exit(2): a zombie whose threads run on as the
    call's uid. The slot must not serve another call while they live: every later call, on
    every slot, finds no task of its uid but its own."""
    sid = one_worker(pool)
    rec = rtx.rt.sandboxes[sid]
    lo, hi = rec.uid_base + 40000, rec.uid_base + 40000 + SLOTS  # the calls' uids, as the host sees them

    def zombie_leaders_of_call_uids() -> list[str]:
        """Seen from the host (a worker's /proc hides other processes from a call): a call uid's
        thread group whose leader is a zombie while its threads run."""
        found = []
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                st = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            ruid = int(st.split("\nUid:")[1].split()[0])
            threads = int(st.split("\nThreads:")[1].split()[0])
            if lo <= ruid < hi and "\nState:\tZ" in st and threads > 1:
                found.append(f"pid {pid} uid {ruid} threads {threads}")
        return found

    for _ in range(2):  # twice: different slots take the attack
        r = run(rtx, pool, ZOMBIE_LEADER)
        assert isinstance(r.value, int)
        assert zombie_leaders_of_call_uids() == []  # the answer came after its threads were killed
        outs = many(rtx, pool, [FnCall(VICTIM) for _ in range(4 * SLOTS)])
        seen = [o.value for o in outs if isinstance(o, FnResult)]
        assert len(seen) == 4 * SLOTS, outs
        assert not [v for v in seen if v["others"]], [v for v in seen if v["others"]]
    assert one_worker(pool) == sid  # the same worker: nothing was given up


# ---------------------------------------------------- a call cannot wedge its worker --

STOP_SPINNER = r'''
import os, signal, time
def main():
    r, w = os.pipe()  # the call's process holds w: its end is the spinner's EOF
    if os.fork() == 0:
        os.close(w)
        os.setsid()
        if os.fork():
            os._exit(0)
        os.read(r, 1)  # until the call's process has ended: the sweep comes next
        end = time.time() + 5
        while time.time() < end:  # stop whatever of this uid runs: the kill helper took it
            try:
                os.kill(-1, signal.SIGSTOP)
            except OSError:
                pass
        os._exit(0)
    time.sleep(0.2)
    return "spinning"
'''


def test_a_leftover_spinning_sigstop_cannot_stop_the_sweep(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    """kill(-1, SIGSTOP) in a loop from a leftover stopped the sweep's kill helper (which took
    the call's uid) and the zygote waited for it forever: the call was never answered and the
    worker was lost with every call on it. The helper's real uid is now one no call has."""
    sid = one_worker(pool)
    restarts = pool.stats.restarts

    async def attack() -> list[Any]:
        spin = asyncio.ensure_future(pool.call(IMAGE, STOP_SPINNER, timeout=10))
        await asyncio.sleep(0.05)
        neighbours = await pool.call_many(IMAGE, [FnCall(NEIGHBOUR, (i,)) for i in range(24)])
        return [*neighbours, await asyncio.gather(spin, return_exceptions=True)]

    outs = rtx.run(attack(), timeout=120)
    neighbours_ok(outs, 24)
    (spun,) = outs[24]
    assert isinstance(spun, FnResult) and spun.value == "spinning", spun
    assert [run(rtx, pool, "def main(i): return i * 3", i).value for i in range(SLOTS * 2)] == \
        [i * 3 for i in range(SLOTS * 2)]
    assert one_worker(pool) == sid and pool.stats.restarts == restarts


FORGE = r'''
import os, stat, struct
def res_fd():
    for fd in range(3, 64):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                return fd
        except OSError:
            pass
def main(kind):
    fd = res_fd()
    if kind == "short":       # a length below the frame head's size
        os.write(fd, struct.pack(">I", 2) + b"EE")
    elif kind == "error-not-json":
        body = b"this is not json"
        os.write(fd, struct.pack(">IBd", 9 + len(body), 0x45, 0.0) + body)
    elif kind == "error-list":
        body = b"[1, 2]"
        os.write(fd, struct.pack(">IBd", 9 + len(body), 0x45, 0.0) + body)
    elif kind == "unknown-kind":
        os.write(fd, struct.pack(">IBd", 9, 0x21, 0.0))
    elif kind == "nan-time":
        os.write(fd, struct.pack(">IBd", 9 + 2, 0x56, float("nan")) + b"42")
    elif kind == "value-not-json":
        os.write(fd, struct.pack(">IBd", 9 + 3, 0x56, 0.0) + b"{{{")
    elif kind == "huge":
        os.write(fd, struct.pack(">I", 0xFFFFFFF0) + b"V" * 64)
    os._exit(0)
'''
FORGERIES = ("short", "error-not-json", "error-list", "unknown-kind", "nan-time", "value-not-json", "huge")


def test_a_forged_result_frame_is_that_calls_own_typed_failure(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    """Every byte on the result pipe is the call's: a frame too short for its head crashed the
    supervisor (every call on the worker lost), an error payload that is not JSON raised out
    of the pool (an HTTP 500, a whole batch dropped). Each is now a typed failure of that call
    alone, in a batch beside calls that succeed."""
    sid = one_worker(pool)
    restarts = pool.stats.restarts
    calls = [FnCall(NEIGHBOUR, (i,)) for i in range(12)] + [FnCall(FORGE, (k,)) for k in FORGERIES]
    outs = many(rtx, pool, calls)
    neighbours_ok(outs, 12)
    for kind, out in zip(FORGERIES, outs[12:], strict=True):
        if kind == "nan-time":  # a well-formed value with a time it made up: the value stands, the time not
            assert isinstance(out, FnResult) and out.value == 42 and out.run_s == 0.0, out
            continue
        assert isinstance(out, FnCallError), (kind, out)
        assert out.fields["exc_type"] in ("ProtocolError", "ProcessExit"), (kind, out.fields)
    assert one_worker(pool) == sid and pool.stats.restarts == restarts


def test_a_call_that_fills_the_disk_fails_alone(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    """A call filled the worker's disk quota from its scratch directory: the next pre-fork could
    not make its scratch directory, and the supervisor gave the worker up. Now the slot waits
    for room, and every call around it runs."""
    sid = one_worker(pool)
    restarts = pool.stats.restarts
    fill = ("import os, time\ndef main():\n    n = 0\n    try:\n        with open('fill', 'wb') as f:\n"
            "            while True:\n                f.write(b'x' * (1 << 20)); f.flush(); n += 1\n"
            "    except OSError as e:\n        err = e.errno\n    time.sleep(5)\n    return [n, err]\n")
    # It holds the disk full for 5 s, past the neighbours' own timeout: they start on the spare
    # scratch directories the worker made ahead (4 a slot), not on room the disk no longer has.
    outs = many(rtx, pool, [FnCall(fill)] + [FnCall(NEIGHBOUR, (i,)) for i in range(20)], timeout=4)
    assert isinstance(outs[0], FnCallTimeout) or (isinstance(outs[0], FnResult) and outs[0].value[0] > 10), outs[0]
    neighbours_ok(outs[1:], 20)
    # The room comes back once the filler's files are removed (the cleaner, then btrfs's
    # accounting at its next commit): the cases after this one need it.
    grab = "def main():\n    open('x', 'wb').write(b'x' * (16 << 20))\n    return 'room'\n"
    for _ in range(60):
        out = rtx.run(pool.call_many(IMAGE, [FnCall(grab)]), timeout=60)[0]
        if isinstance(out, FnResult):
            break
        rtx.run(asyncio.sleep(0.5))
    assert isinstance(out, FnResult) and out.value == "room", out
    assert one_worker(pool) == sid and pool.stats.restarts == restarts


def test_a_tree_too_deep_for_rmtree_does_not_stop_the_cleaner(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    """A call left a tree 1,500 levels deep: shutil.rmtree's recursion killed the cleaner
    thread, and every later call that left a file waited forever for a slot. The cleaner is
    iterative now; every call after runs and leaves nothing."""
    sid = one_worker(pool)
    restarts = pool.stats.restarts
    deep = ("import os\ndef main():\n    fd = os.open('.', os.O_RDONLY)\n    for i in range(1500):\n"
            "        os.mkdir('d' * 100, dir_fd=fd)\n        nfd = os.open('d' * 100, os.O_RDONLY, dir_fd=fd)\n"
            "        os.close(fd); fd = nfd\n    os.close(fd)\n    return 'deep'\n")
    assert run(rtx, pool, deep).value == "deep"
    leave = "def main(i):\n    open('left', 'w').write('x')\n    return i * 3\n"
    outs = many(rtx, pool, [FnCall(leave, (i,)) for i in range(4 * SLOTS)], timeout=15)
    neighbours_ok(outs, 4 * SLOTS)
    scratch = Path(f"/proc/{rtx.rt.sandboxes[sid].init_pid}/root/fncall")

    def only_fresh() -> bool:  # empty scratch directories: the waiting call processes' and the spares
        try:  # the cleaner may remove an entry between the listing and its read: read again
            dirs = list(scratch.iterdir())
            return len(dirs) <= SLOTS * (1 + SPARES_PER_SLOT) and not any(any(d.iterdir()) for d in dirs)
        except FileNotFoundError:
            return False

    assert wait_until(only_fresh, timeout=30), sorted(p.name for p in scratch.iterdir())
    assert one_worker(pool) == sid and pool.stats.restarts == restarts


def test_a_waiting_call_process_killed_costs_its_slot_a_fork_not_the_worker(rtx: RuntimeHarness,
                                                                           pool: FnCallPool) -> None:
    """The memory cgroup's OOM killer may take a call process that waits for its request (they
    all have oom_score_adj 1000). That was fatal to the worker; now its slot forks again."""
    sid = one_worker(pool)
    restarts = pool.stats.restarts
    rec = rtx.rt.sandboxes[sid]
    lo, hi = rec.uid_base + 40000, rec.uid_base + 40000 + SLOTS  # the calls' uids, as the host sees them
    waiting = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        ruid = int(status.split("\nUid:")[1].split()[0])
        if lo <= ruid < hi:
            waiting.append(pid)
    assert waiting, "no waiting call process found"
    for pid in waiting[:3]:
        os.kill(pid, signal.SIGKILL)
    outs = many(rtx, pool, [FnCall(NEIGHBOUR, (i,)) for i in range(3 * SLOTS)])
    neighbours_ok(outs, 3 * SLOTS)
    assert one_worker(pool) == sid and pool.stats.restarts == restarts


# ----------------------------------------------------------------- memory is a bound --

MEMFD = ("import os\ndef main(mib):\n    fds = []\n    for i in range(mib // 16):\n"
         "        fd = os.memfd_create(f'm{i}')\n        os.write(fd, b'x' * (16 << 20))\n        fds.append(fd)\n"
         "    return len(fds) * 16\n")
PIPES = ("import os, fcntl\ndef main(mib):\n    held = 0\n    ends = []\n    chunk = b'x' * 65536\n"
         "    while held < mib << 20:\n        r, w = os.pipe()\n        os.set_blocking(w, False)\n"
         "        try:\n            fcntl.fcntl(w, 1031, 1 << 20)\n        except OSError:\n            pass\n"
         "        while True:\n            try:\n                held += os.write(w, chunk)\n"
         "            except BlockingIOError:\n                break\n        ends += [r, w]\n"
         "    return held >> 20\n")


@pytest.mark.parametrize("how", ["memfd", "pipes"])
def test_memory_bounds_what_a_call_holds_outside_its_address_space(rtx: RuntimeHarness, pool: FnCallPool,
                                                                   how: str) -> None:
    """``memory`` was RLIMIT_AS only: a call held 384 MiB in memfds (or pipe buffers) with
    ``memory`` = 32 MiB. Each slot is a memory cgroup now, limited to the call's ``memory``."""
    src = MEMFD if how == "memfd" else PIPES
    out = rtx.run(pool.call_many(IMAGE, [FnCall(src, (384,))] + [FnCall(NEIGHBOUR, (i,)) for i in range(8)],
                                 memory=32 * MiB), timeout=120)
    assert isinstance(out[0], FnCallOOM), out[0]
    neighbours_ok(out[1:], 8)
    # Within its bound the same call succeeds: the bound is the call's, not a blanket refusal.
    assert run(rtx, pool, src, 16, memory=64 * MiB).value >= 16


# ------------------------------------------------------------------- what callers hear --

def test_an_exception_bigger_than_half_the_cap_is_an_error_with_its_traceback(rtx: RuntimeHarness,
                                                                             pool: FnCallPool) -> None:
    """Its message was cut to the cap and its traceback to the cap again: over the cap together,
    reported as FnCallOutputTooLarge for "stdout or stderr" with nothing printed."""
    src = "def boom(n):\n    raise ValueError('x' * n)\n\ndef main(n):\n    return boom(n)\n"
    for n in (700_000, 3 * MiB):  # over half the cap; over the cap itself
        with pytest.raises(FnCallError) as info:
            run(rtx, pool, src, n, output_cap=1 * MiB)
        e = info.value
        assert e.fields["exc_type"] == "ValueError"
        msg = e.fields["exc_message"]
        assert set(msg[:-5]) == {"x"} and (len(msg) == n if n < MiB else MiB // 4 < len(msg) < MiB), len(msg)
        assert "boom" in e.fields["traceback"] and "raise ValueError" in e.fields["traceback"]
        assert e.stdout == "" and e.stderr == ""


def test_a_lost_worker_tells_callers_why_not_its_log(rtx: RuntimeHarness, py_image: ImageRef) -> None:
    """FnCallWorkerLost carried the supervisor's log tail (tracebacks, scratch paths of other
    calls) to every caller on the worker; and said "worker None" after the grace."""
    cfg = FnCallConfig(images=(FnCallImage(image=py_image, concurrency=2, spare=0),), answer_grace_s=1)
    p = FnCallPool(cfg, rtx.rt, name="tlost")
    rtx.run(p.start())
    try:
        (w,) = p.workers()
        old = w.sandbox_id

        async def lose() -> BaseException | None:
            task = asyncio.ensure_future(p.call(py_image, "import sys, time\nprint('/fncall/secret', file=sys.stderr)"
                                                          "\ntime.sleep(30)"))
            await asyncio.sleep(0.5)
            os.kill(w.supervisor_pid or 0, signal.SIGKILL)
            try:
                await task
            except BaseException as exc:
                return exc
            return None

        exc = rtx.run(lose())
        assert isinstance(exc, FnCallWorkerLost), exc
        assert "log" not in str(exc) and "/fncall" not in str(exc) and "Traceback" not in str(exc), str(exc)
        assert exc.fields["worker"] == old and old in str(exc)

        # No answer within the grace: the worker id is named (it was cleared before the message).
        assert rtx.run(p.call(py_image, "'back'"), timeout=120).value == "back"  # waits for the replacement
        (w2,) = p.workers()
        os.kill(w2.supervisor_pid or 0, signal.SIGSTOP)
        try:
            with pytest.raises(FnCallWorkerLost) as info:
                rtx.run(p.call(py_image, "1", timeout=1), timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the pool destroyed it meanwhile
                os.kill(w2.supervisor_pid or 0, signal.SIGCONT)
        assert "None" not in str(info.value) and info.value.fields["worker"], str(info.value)
    finally:
        rtx.run(p.close())


# ------------------------------------------------------------ channels across time --

TALK = ("import socket\ndef main():\n    s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "    c = socket.create_connection(s.getsockname()); a, _ = s.accept()\n"
        "    a.sendall(b'x'); c.recv(1)\n    port = s.getsockname()[1]\n    c.close(); a.close(); s.close()\n"
        "    return port\n")
LISTEN = ("def main(port):\n    seen = []\n    for name in ('/proc/net/tcp', '/proc/net/tcp6'):\n"
          "        try:\n            lines = open(name).read().splitlines()[1:]\n        except OSError:\n"
          "            continue\n        for ln in lines:\n            f = ln.split()\n"
          "            if int(f[1].split(':')[1], 16) == port or int(f[2].split(':')[1], 16) == port:\n"
          "                seen.append(ln)\n    return seen\n")


def test_a_closed_loopback_connection_leaves_nothing_for_later_calls(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    """A connection a call closed stayed in TIME_WAIT in /proc/net/tcp for a minute, readable by
    the calls after it (ports, a channel across time). Workers keep no TIME_WAIT sockets."""
    port = run(rtx, pool, TALK).value
    assert isinstance(port, int) and port > 0
    assert run(rtx, pool, LISTEN, port).value == []


HANDER = r'''
import array, os, socket, time
def main(name, mib):
    fd = os.memfd_create("gift")
    chunk = b"x" * (1 << 20)
    for _ in range(mib):
        os.write(fd, chunk)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.time() + 5
    while True:
        try:
            s.connect("\0" + name)
            break
        except OSError:
            if time.time() > deadline:
                return "no taker"
            time.sleep(0.01)
    s.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    s.recv(1)
    return "handed"
'''
TAKER = r'''
import array, os, socket, time
def main(name, hold):
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0" + name)
    srv.listen()
    c, _ = srv.accept()
    msg, anc, _f, _a = c.recvmsg(1, socket.CMSG_SPACE(4))
    c.send(b"k")
    time.sleep(hold)  # holds the memfd its giver's slot was charged for
    return len(anc)
'''
EATER = "def main(mib):\n    b = bytearray(mib << 20)\n    return len(b) >> 20\n"


def test_a_charge_handed_to_a_concurrent_call_does_not_starve_the_givers_slot(rtx: RuntimeHarness,
                                                                               pool: FnCallPool) -> None:
    """A call hands a memfd its slot's cgroup paid for to a concurrent call, which holds it after
    the giver ended: the giver's slot stays charged. Its next calls still get their own
    ``memory`` (the limit is the call's memory on top of what the slot holds)."""
    name = f"dsec-gift-{os.getpid()}"

    async def scene() -> list[Any]:
        taker = asyncio.ensure_future(pool.call(IMAGE, TAKER, [name, 6.0], memory=64 * MiB, timeout=20))
        await asyncio.sleep(0.3)
        gave = await pool.call(IMAGE, HANDER, [name, 24], memory=32 * MiB, timeout=20)
        eaters = await pool.call_many(IMAGE, [FnCall(EATER, (20,)) for _ in range(3 * SLOTS)], memory=32 * MiB,
                                      timeout=20)
        return [gave, *eaters, await taker]

    outs = rtx.run(scene(), timeout=120)
    assert isinstance(outs[0], FnResult) and outs[0].value == "handed", outs[0]
    bad = [o for o in outs[1:-1] if not (isinstance(o, FnResult) and o.value == 20)]
    assert not bad, bad
    assert isinstance(outs[-1], FnResult) and outs[-1].value == 1, outs[-1]
