"""FnCall against the real thing: worker sandboxes of the real container runtime on a real
EROFS layer (Debian bookworm with python3 and python3-numpy, made once with debootstrap
and cached under $DSEC_STATE_DIR/cache), numpy preloaded in the template.

The contract (values, arguments, exceptions, timeouts, memory and output caps), load (200
calls in a row and at once), every isolation case as its own test (a call tries to leave
state for the next one or to read or disturb a concurrent one; each must be refused), and
a worker killed in the middle of a call."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import RuntimeHarness, all_pids, pid_alive, proc_cmdline, wait_until
from dsec.backends.base import Backend, Capability
from dsec.backends.fncall.backend import FnCallBackend
from dsec.backends.fncall.config import FnCallConfig, FnCallImage
from dsec.backends.fncall.pool import LABEL, FnCallPool
from dsec.bench import fncall as bench
from dsec.errors import ExecTimeout, InvalidSpec, LayerNotFound, Unsupported
from dsec.spec import ImageRef, SandboxSpec
from dsec.spec.fncall import (
    FnCall,
    FnCallError,
    FnCallFailed,
    FnCallOOM,
    FnCallOutputTooLarge,
    FnCallTimeout,
    FnCallWorkerLost,
    FnResult,
)

pytestmark = [pytest.mark.root, pytest.mark.timeout(900)]

MiB = 1 << 20
CACHE = Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec")) / "cache"
IMAGE = ImageRef(base="pyfn:test")


@pytest.fixture(scope="module")
def py_image(rtx: RuntimeHarness) -> ImageRef:
    have_cache = (CACHE / ("debian-bookworm-" + "-".join(sorted(bench.PACKAGES))) / ".dsec-complete").exists()
    if not have_cache and shutil.which("debootstrap") is None:
        pytest.skip("needs debootstrap (or a cached Debian python3-numpy rootfs) for a python layer")
    bench.python_layer(rtx.rt.store, CACHE, name="pyfn", tag="test")
    return IMAGE


@pytest.fixture(scope="module")
def pool(rtx: RuntimeHarness, py_image: ImageRef) -> Iterator[FnCallPool]:
    cfg = FnCallConfig(images=(FnCallImage(image=py_image, preload=("numpy",), concurrency=4, spare=2),),
                       call_timeout_s=20)
    p = FnCallPool(cfg, rtx.rt, name="tpool")
    rtx.run(p.start())
    assert all(w.ready for w in p.workers()), [w.reason for w in p.workers()]
    try:
        yield p
    finally:
        rtx.run(p.close())
    assert not [s for s in rtx.rt.sandboxes.values() if s.spec.labels.get(LABEL)], "worker sandboxes left"


def call(rtx: RuntimeHarness, pool: FnCallPool, source: str, *args: Any, kwargs: dict[str, Any] | None = None,
         **opts: Any) -> FnResult:
    return rtx.run(pool.call(IMAGE, source, list(args), kwargs, **opts))


def fails(rtx: RuntimeHarness, pool: FnCallPool, source: str, *args: Any, **opts: Any) -> FnCallFailed:
    with pytest.raises(FnCallFailed) as info:
        rtx.run(pool.call(IMAGE, source, list(args), **opts))
    return info.value


def host_pids_with(marker: str) -> list[int]:
    return [p for p in all_pids() if pid_alive(p) and marker in " ".join(proc_cmdline(p))]


# ----------------------------------------------------------------- contract --


def test_the_last_expression_is_the_value(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    r = call(rtx, pool, "x = 20\nx + 22")
    assert r.value == 42 and r.stdout == "" and r.stderr == ""
    assert call(rtx, pool, "x = 1").value is None  # no trailing expression
    assert call(rtx, pool, "{'a': [1, 2.5, None, True], 'b': 'é'}").value == {"a": [1, 2.5, None, True], "b": "é"}
    assert r.worker in pool.worker_sandboxes() and r.duration_s > 0 and r.run_s >= 0


def test_main_gets_args_and_kwargs_and_numpy_is_warm(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    src = ("import numpy as np, sys\n"
           "def main(a, b, *, scale=1):\n"
           "    print('dot', file=sys.stderr); print('hello')\n"
           "    return {'dot': float(np.dot(a, b)) * scale, 'arr': np.arange(3), 'i': np.int64(7)}\n")
    r = call(rtx, pool, src, [1, 2, 3], [4, 5, 6], kwargs={"scale": 2})
    assert r.value == {"dot": 64.0, "arr": [0, 1, 2], "i": 7}
    assert r.stdout == "hello\n" and r.stderr == "dot\n"
    # numpy was imported by the template: importing it in the call costs nothing.
    t = call(rtx, pool, "import time, sys\nt = time.perf_counter()\nimport numpy\n"
                        "[time.perf_counter() - t, 'numpy' in sys.modules]")
    assert t.value[0] < 0.005 and t.value[1] is True
    # An explicit entry point; async functions are awaited.
    assert call(rtx, pool, "def f(x): return x + 1\ndef main(): return 0", 1, entry="f").value == 2
    assert call(rtx, pool, "async def main(x):\n    return x * 3", 5).value == 15


def test_an_exception_comes_back_typed_with_the_calls_own_traceback(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    src = "def helper(x):\n    return 1 / x\n\ndef main(x):\n    print('before')\n    return helper(x)\n"
    e = fails(rtx, pool, src, 0)
    assert isinstance(e, FnCallError) and isinstance(e, RuntimeError)
    assert e.exc_type == "ZeroDivisionError" and e.exc_message == "division by zero"
    assert e.message == "ZeroDivisionError: division by zero"
    tb = e.traceback
    assert 'File "<fncall>", line 6, in main' in tb and "return helper(x)" in tb
    assert 'File "<fncall>", line 2, in helper' in tb and tb.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "worker.py" not in tb  # only the call's own frames
    assert e.fields["stdout"] == "before\n"
    e = fails(rtx, pool, "import numpy as np\nnp.linalg.inv(np.zeros((2, 2)))")
    assert isinstance(e, FnCallError) and e.exc_type == "numpy.linalg.LinAlgError"
    e = fails(rtx, pool, "def main():\n    return object()")
    assert isinstance(e, FnCallError) and e.exc_type == "TypeError" and "JSON" in e.exc_message
    e = fails(rtx, pool, "x = 1", 1, 2)  # arguments, but no main()
    assert isinstance(e, FnCallError) and e.exc_type == "TypeError"
    e = fails(rtx, pool, "def main(:\n")
    assert isinstance(e, FnCallError) and e.exc_type == "SyntaxError"
    e = fails(rtx, pool, "import os\nos._exit(3)")
    assert isinstance(e, FnCallError) and e.exc_type == "ProcessExit" and e.fields["exit_code"] == 3
    e = fails(rtx, pool, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert isinstance(e, FnCallError) and e.exc_type == "Signal" and e.fields["signal"] == signal.SIGSEGV


def test_bad_input_is_refused_before_any_call(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    with pytest.raises(InvalidSpec):
        call(rtx, pool, "1", object())
    with pytest.raises(InvalidSpec):
        call(rtx, pool, "1", timeout=0)
    with pytest.raises(InvalidSpec):
        call(rtx, pool, "1", timeout=None)  # this pool has a ceiling
    with pytest.raises(InvalidSpec):
        call(rtx, pool, "1", memory=1 << 50)
    with pytest.raises(InvalidSpec):
        call(rtx, pool, "1", entry="not an identifier")


def test_a_timeout_kills_the_call_and_every_process_it_started(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    marker = f"{secrets.randbelow(10**6) + 1000}.{secrets.randbelow(1000)}"
    src = ("import os, subprocess, time\n"
           "def main(m):\n"
           "    subprocess.Popen(['sleep', m])\n"
           "    subprocess.Popen(['sleep', m], start_new_session=True)\n"
           "    if os.fork() == 0:\n"
           "        os.setsid()\n"
           "        os.execvp('sleep', ['sleep', m])\n"
           "    time.sleep(60)\n")
    t = time.monotonic()
    e = fails(rtx, pool, src, marker, timeout=1.5)
    took = time.monotonic() - t
    assert isinstance(e, FnCallTimeout) and isinstance(e, ExecTimeout) and isinstance(e, TimeoutError)
    assert e.fields["timeout"] == 1.5 and 1.4 < took < 6, took
    # Answered only once they are gone: the host sees none of them.
    assert host_pids_with(f"sleep {marker}") == []
    assert call(rtx, pool, "7").value == 7  # the worker carries on


def test_the_memory_cap_is_an_oom_error(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    e = fails(rtx, pool, "x = bytearray(512 * 1024 * 1024)", memory=64 * MiB)
    assert isinstance(e, FnCallOOM) and isinstance(e, MemoryError) and e.fields["memory"] == 64 * MiB
    e = fails(rtx, pool, "import numpy as np\nnp.ones((1024, 1024, 128))", memory=64 * MiB)
    assert isinstance(e, FnCallOOM)
    # Under the cap is fine, and so is the next call.
    assert call(rtx, pool, "len(bytearray(16 * 1024 * 1024))", memory=64 * MiB).value == 16 * MiB
    e = fails(rtx, pool, "x = []\nwhile True:\n    x.append(bytearray(1 << 20))", memory=32 * MiB)
    assert isinstance(e, FnCallOOM)


def test_output_past_the_cap_is_an_error(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    t = time.monotonic()
    e = fails(rtx, pool, "import sys\nwhile True:\n    sys.stdout.write('y' * 4096)", output_cap=64 * 1024, timeout=15)
    assert time.monotonic() - t < 5  # killed at the cap, not at the timeout
    assert isinstance(e, FnCallOutputTooLarge) and e.fields["what"] == "stdout or stderr"
    assert e.fields["stdout"] == "y" * 64 * 1024
    e = fails(rtx, pool, "'z' * 100000", output_cap=64 * 1024)
    assert isinstance(e, FnCallOutputTooLarge) and e.fields["what"] == "result"
    assert call(rtx, pool, "print('ok')\n1", output_cap=1024).stdout == "ok\n"


def test_a_call_resolves_localhost_and_its_workers_own_name(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    """The image is a debootstrap minbase (no /etc/hosts; its /etc/hostname is the build
    machine's): a call still resolves localhost, and the worker's name is its own (issue 27)."""
    src = ("import socket\n"
           "def main():\n"
           "    name = socket.gethostname()\n"
           "    srv = socket.create_server(('localhost', 0))\n"
           "    with socket.create_connection(('localhost', srv.getsockname()[1]), timeout=5):\n"
           "        pass\n"
           "    return [socket.gethostbyname('localhost'), name, socket.gethostbyname(name),\n"
           "            open('/etc/hostname').read()]\n")
    r = call(rtx, pool, src)
    assert r.value == ["127.0.0.1", r.worker, "127.0.1.1", r.worker + "\n"], r


def test_200_calls_in_a_row_each_a_fresh_process(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    src = "import os\ncount = 0\ndef main(i):\n    global count\n    count += 1\n    return [i, os.getpid(), count]\n"
    out = [call(rtx, pool, src, i).value for i in range(200)]
    assert [o[0] for o in out] == list(range(200))
    assert all(o[2] == 1 for o in out)  # a fresh module every time
    assert len({o[1] for o in out}) == 200  # a fresh process every time


def test_200_calls_at_once(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    src = "import os, time\ndef main(i):\n    time.sleep(0.01)\n    return [i, os.getuid()]\n"
    outs = rtx.run(pool.call_many(IMAGE, [FnCall(src, (i,)) for i in range(200)] + ["1/0"]))
    assert isinstance(outs[-1], FnCallError) and outs[-1].exc_type == "ZeroDivisionError"
    values = [o.value for o in outs[:-1] if isinstance(o, FnResult)]
    assert [v[0] for v in values] == list(range(200))
    uids = {v[1] for v in values}
    assert all(u >= pool.config.call_uid_base for u in uids) and len(uids) > 1


def test_large_arguments_and_results_stream_through(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    blob = "ab" * (3 * MiB)  # 6 MiB each way: more than any pipe holds at once
    r = call(rtx, pool, "def main(s):\n    print(len(s))\n    return s[::-1]", blob, output_cap=8 * MiB)
    assert r.value == blob[::-1] and r.stdout == f"{len(blob)}\n"


def test_a_cancelled_call_is_killed_in_the_worker(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    marker = f"{secrets.randbelow(10**6) + 1000}.{secrets.randbelow(1000)}"

    async def cancel_one() -> None:
        task = asyncio.ensure_future(pool.call(IMAGE, "import subprocess\ndef main(m):\n"
                                                      "    subprocess.run(['sleep', m])", [marker], timeout=60))
        assert await asyncio.to_thread(wait_until, lambda: bool(host_pids_with(f"sleep {marker}")), 10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    rtx.run(cancel_one())
    assert wait_until(lambda: not host_pids_with(f"sleep {marker}"), timeout=10)
    assert call(rtx, pool, "'after'").value == "after"


def test_a_call_that_forges_its_result_and_lives_on_is_killed(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    """A call can write its own result frame (the pipe is its own) and keep running: it gets
    the answer it forged, and its process is killed a few seconds later all the same."""
    marker = f"{secrets.randbelow(10**6) + 1000}.{secrets.randbelow(1000)}"
    src = ("import os, struct\n"
           "def main(m):\n"
           "    for fd in [int(f) for f in os.listdir('/proc/self/fd') if int(f) > 2]:\n"
           "        try:\n"
           "            os.write(fd, struct.pack('>IBd', 17, 0x56, 0.0) + b'\"forged\"')\n"
           "        except OSError:\n"
           "            pass\n"
           "    os.execvp('sleep', ['sleep', m])\n")
    t = time.monotonic()
    assert call(rtx, pool, src, marker, timeout=60).value == "forged"
    seen = wait_until(lambda: bool(host_pids_with(f"sleep {marker}")), timeout=0.4)  # it may be gone already
    assert wait_until(lambda: not host_pids_with(f"sleep {marker}"), timeout=10)
    assert time.monotonic() - t < 5, seen
    assert call(rtx, pool, "'next'").value == "next"


# ---------------------------------------------------------------- isolation --
# One test per case: the first call tries to leave (or take) something; the next call, or
# a concurrent one, must not see it. The bench runs the same cases (dsec.bench.fncall).


def isolation_case(rtx: RuntimeHarness, pool: FnCallPool, name: str) -> tuple[Any, Any]:
    first, check = bench.ISOLATION_CASES[name]
    left = call(rtx, pool, first).value
    seen = call(rtx, pool, check, *([left] if name == "background_process" else [])).value
    return left, seen


def test_isolation_a_file_in_tmp_or_the_scratch_dir_is_not_seen_by_the_next_call(
        rtx: RuntimeHarness, pool: FnCallPool) -> None:
    left, seen = isolation_case(rtx, pool, "tmp_file")
    assert left == [] and seen == []
    # The call's own scratch directory is its cwd, HOME and TMPDIR, empty at start.
    v = call(rtx, pool, "import os, tempfile\n[os.getcwd(), os.environ['HOME'], tempfile.gettempdir(), os.listdir('.')]")
    assert v.value[0] == v.value[1] == v.value[2] and v.value[0].startswith("/fncall/") and v.value[3] == []
    v = call(rtx, pool, "import getpass, os, tempfile\n"
                        "[getpass.getuser(), os.path.dirname(tempfile.mkstemp()[1]) == os.getcwd()]")
    assert v.value[0].startswith("fncall") and v.value[1] is True


def test_isolation_a_global_set_by_a_call_is_gone_for_the_next(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    assert isolation_case(rtx, pool, "global") == ([], [])


def test_isolation_an_environment_variable_is_gone_for_the_next(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    assert isolation_case(rtx, pool, "env") == ([], [])


def test_isolation_a_background_process_does_not_outlive_its_call(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    left, seen = isolation_case(rtx, pool, "background_process")
    assert len(left) == 1 and seen == []


def test_isolation_the_template_memory_cannot_be_written(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    left, _ = isolation_case(rtx, pool, "template_memory")
    assert left == []  # /proc/<zygote or supervisor>/mem: EACCES
    v = call(rtx, pool, "import os\ntry:\n    open(f'/proc/{os.getppid()}/mem', 'rb')\nexcept OSError as e:\n"
                        "    r = [e.errno, os.getuid()]\nr")
    # EACCES, or ENOENT: a worker's /proc shows a call only its own uid's processes (hidepid)
    assert v.value[0] in (2, 13) and v.value[1] >= pool.config.call_uid_base


def test_isolation_site_packages_cannot_be_written(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    assert isolation_case(rtx, pool, "site_packages") == ([], [])


def test_isolation_sysv_ipc_and_message_queues_are_refused(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    assert isolation_case(rtx, pool, "ipc") == ([], [])


def test_isolation_a_call_cannot_signal_ptrace_or_read_a_concurrent_one(rtx: RuntimeHarness,
                                                                        pool: FnCallPool) -> None:
    async def both() -> tuple[Any, Any]:
        secret = "s3cr3t-" + secrets.token_hex(4)
        v, a = await asyncio.gather(pool.call(IMAGE, bench.CONCURRENT_VICTIM, [secret]),
                                    pool.call(IMAGE, bench.CONCURRENT_ATTACKER, [secret]))
        return v.value, a.value

    victim, attacker = rtx.run(both())
    assert victim.startswith("alive:")  # neither killed nor stopped
    assert attacker == []  # no kill, no ptrace, the secret in no environ, cmdline, mem or maps


def test_isolation_numpy_random_state_differs_between_calls(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    src = "import numpy as np, random\n[float(np.random.random()), random.random()]"
    a, b = call(rtx, pool, src).value, call(rtx, pool, src).value
    assert a[0] != b[0] and a[1] != b[1]
    # Reseeded by writing the generator's state (NumpySeed): a full key, a valid generator.
    src = ("import numpy as np\n"
           "st = np.random.get_state()\n"
           "[st[1][:4].tolist(), int(st[2]), int(st[3]), float(np.random.standard_normal()),"
           " float(np.random.random())]")
    a, b = call(rtx, pool, src).value, call(rtx, pool, src).value
    assert a[0] != b[0] and a[1] == b[1] == 624 and a[2] == b[2] == 0  # fresh key, no cached gaussian
    assert a[3] != b[3] and 0 <= a[4] < 1
    seeded = "import numpy as np\nnp.random.seed(7)\n[float(np.random.random()), float(np.random.normal())]"
    assert call(rtx, pool, seeded).value == call(rtx, pool, seeded).value  # a call's own seeding still holds


def test_calls_are_forked_without_cpythons_hooks_and_threads_still_work(rtx: RuntimeHarness,
                                                                        pool: FnCallPool) -> None:
    """The zygote forks with the C library's fork (docs/FNCALL.md, "Where the CPU goes"): the
    fast paths are in use, and what os.fork's hooks would have set up still works in a call."""
    for w in pool.workers():
        assert w.info["fork"] == "libc" and w.info["numpy_seed"] == "state", w.info
    src = ("import os, random, threading\n"
           "def main():\n"
           "    out = []\n"
           "    t = threading.Thread(target=lambda: out.append(threading.current_thread().name))\n"
           "    t.start(); t.join()\n"
           "    r, w = os.pipe()\n"
           "    pid = os.fork()\n"
           "    if pid == 0:\n"
           "        t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
           "        os.write(w, repr(random.random()).encode()); os._exit(0)\n"
           "    os.close(w); child = float(os.read(r, 100)); os.waitpid(pid, 0)\n"
           "    return [out, threading.current_thread() is threading.main_thread(),\n"
           "            threading.active_count(), child != random.random()]\n")
    v = call(rtx, pool, src).value
    assert v[0] and v[1] is True and v[2] == 1 and v[3] is True


def test_an_exit_without_a_result_reports_its_status(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    """The zygote reaps lazily and reports only failures unasked: a clean exit(0) with no
    result is asked for ("W") and still comes back as ProcessExit 0."""
    for code in (0, 0, 5):
        e = fails(rtx, pool, f"import os, sys\nsys.stdout.flush()\nos._exit({code})")
        assert isinstance(e, FnCallError) and e.exc_type == "ProcessExit" and e.fields["exit_code"] == code
    assert call(rtx, pool, "'after'").value == "after"


def test_isolation_a_call_that_becomes_a_subreaper_leaves_nothing(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    """Orphans re-parented to the call's own process (PR_SET_CHILD_SUBREAPER) instead of the
    zygote are its children until it exits, then the zygote's: the sweep finds them either way."""
    marker = f"{secrets.randbelow(10**6) + 1000}.{secrets.randbelow(1000)}"
    src = ("import ctypes, os\n"
           "def main(m):\n"
           "    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\n"
           "    if os.fork() == 0:\n"
           "        if os.fork() == 0:\n"
           "            os.execvp('sleep', ['sleep', m])\n"
           "        os._exit(0)\n"
           "    os.wait()\n"
           "    return os.getpid()\n")
    call(rtx, pool, src, marker)
    assert host_pids_with(f"sleep {marker}") == []  # answered only once it was gone
    assert call(rtx, pool, "'next'").value == "next"


def test_the_bench_isolation_cases_all_pass(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    async def one(source: str, args: list[Any]) -> Any:
        return (await pool.call(IMAGE, source, args)).value

    assert rtx.run(bench.run_isolation_cases(one)) == len(bench.ISOLATION_CASES) + 1


# ------------------------------------------------------------------ workers --


def test_worker_sandboxes_are_labelled_and_locked_down(rtx: RuntimeHarness, pool: FnCallPool) -> None:
    sids = pool.worker_sandboxes()
    assert sids
    for sid in sids:
        rec = rtx.rt.get(sid)
        assert rec.spec.labels[LABEL] == "worker" and rec.spec.labels["dsec.fncall.pool"] == "tpool"
        r = rtx.sh(sid, ["stat", "-c", "%a %U", "/tmp", "/var/tmp", "/dev/shm", "/fncall", "/opt/dsec-fncall/worker.py"])
        modes = [line.split() for line in r.stdout.decode().splitlines()]
        assert all(int(m, 8) & 0o002 == 0 and u == "root" for m, u in modes), modes  # nobody else may write
        assert [m for m, _ in modes[3:]] == ["711", "644"]


def test_a_worker_killed_mid_call_fails_the_call_typed_and_is_replaced(rtx: RuntimeHarness,
                                                                       py_image: ImageRef) -> None:
    cfg = FnCallConfig(images=(FnCallImage(image=py_image, concurrency=2, spare=0),))
    p = FnCallPool(cfg, rtx.rt, name="tkill")
    rtx.run(p.start())
    try:
        (w,) = p.workers()
        old = w.sandbox_id

        async def kill_during_call() -> BaseException | None:
            task = asyncio.ensure_future(p.call(py_image, "import time\ntime.sleep(30)"))
            await asyncio.sleep(0.5)
            os.kill(w.supervisor_pid or 0, signal.SIGKILL)  # the supervisor, from the host
            try:
                await task
            except BaseException as exc:
                return exc
            return None

        exc = rtx.run(kill_during_call())
        assert isinstance(exc, FnCallWorkerLost) and exc.fields["worker"] == old
        assert call(rtx, p, "'back'").value == "back"  # waits for the replacement
        (w2,) = p.workers()
        assert w2.sandbox_id != old and w2.ready
        assert wait_until(lambda: old not in rtx.rt.sandboxes, timeout=10)
        assert p.stats.restarts == 1
    finally:
        rtx.run(p.close())


def test_a_worker_that_stops_answering_is_lost_after_the_grace(rtx: RuntimeHarness, py_image: ImageRef) -> None:
    """The pool's own clock (a timer on the call's future): a supervisor that is stopped
    answers nothing; the call fails FnCallWorkerLost("unresponsive") at timeout + grace and
    the worker is replaced."""
    cfg = FnCallConfig(images=(FnCallImage(image=py_image, concurrency=1, spare=0),), answer_grace_s=0.5)
    p = FnCallPool(cfg, rtx.rt, name="tstall")
    rtx.run(p.start())
    try:
        (w,) = p.workers()
        old, sup = w.sandbox_id, w.supervisor_pid or 0
        os.kill(sup, signal.SIGSTOP)
        try:
            t = time.monotonic()
            e = fails(rtx, p, "1", timeout=0.5)
            took = time.monotonic() - t
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(sup, signal.SIGCONT)
        assert isinstance(e, FnCallWorkerLost) and e.fields["reason"] == "unresponsive", e
        assert 0.9 < took < 10, took
        assert rtx.run(p.call(py_image, "'back'")).value == "back"
        assert p.workers()[0].sandbox_id != old
    finally:
        rtx.run(p.close())


def test_an_unconfigured_image_gets_a_worker_on_first_use(rtx: RuntimeHarness, py_image: ImageRef) -> None:
    p = FnCallPool(FnCallConfig(), rtx.rt, name="tlazy")
    rtx.run(p.start())
    try:
        assert not p.workers()
        assert rtx.run(p.call("pyfn:test", "'lazy'")).value == "lazy"
        assert len(p.workers()) == 1
        with pytest.raises(LayerNotFound):  # said at once, not retried forever
            rtx.run(p.call("nosuchimage:1", "1"))
    finally:
        rtx.run(p.close())
    strict = FnCallPool(FnCallConfig(lazy_images=False), rtx.rt, name="tstrict")
    rtx.run(strict.start())
    try:
        with pytest.raises(InvalidSpec):
            rtx.run(strict.call("pyfn:test", "1"))
    finally:
        rtx.run(strict.close())


def test_the_backend_holds_no_sandboxes_and_refuses_sandbox_operations(rtx: RuntimeHarness,
                                                                       py_image: ImageRef) -> None:
    b = FnCallBackend(FnCallConfig(images=(FnCallImage(image=py_image, concurrency=1, spare=0),)), name="tback",
                      host=rtx.rt)
    assert isinstance(b, Backend) and b.kind == "fncall"
    assert b.capabilities.ops == frozenset({Capability.FNCALL})
    rtx.run(b.start())
    try:
        assert dict(b.sandboxes) == {} and b.list() == []
        with pytest.raises(Unsupported):
            rtx.run(b.create(SandboxSpec(image=py_image)))
        with pytest.raises(Unsupported):
            rtx.run(b.pause("x"))
        assert rtx.run(b.call(py_image, "6 * 7")).value == 42
        outs = rtx.run(b.call_many(py_image, ["1", "2", "1/0"]))
        assert [o.value for o in outs[:2] if isinstance(o, FnResult)] == [1, 2] and isinstance(outs[2], FnCallError)
    finally:
        rtx.run(b.close())
