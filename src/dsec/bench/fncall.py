"""``dsec bench fncall``: function calls on warm workers, beside a sandbox per call, in one run.

Figures, not assertions. Every figure comes from the same image (Debian bookworm
with python3 and python3-numpy, built once with debootstrap and cached) and the
same snippet, a numpy reward function::

    import numpy as np
    def main(a, b): return float(np.dot(np.asarray(a), np.asarray(b)))

- ``fncall_p50_ms`` / ``fncall_p90_ms``: one call after another (``n_seq``), numpy
  already imported in the template; through the pool directly (``fncall_pool_*``) and,
  when an SDK client is given, end to end through the SDK and the edge
  (``fncall_sdk_*``; ``fncall_p50_ms`` is then the SDK's). ``*_paced_*``: the same with
  20 ms between calls.
- ``fncall_cpu_ms_per_call``: CPU per call during the concurrent phase, host side and in
  the worker (supervisor, zygote, call processes); ``fncall_per_s_cpu_bound`` = cores / that.
  Split: ``fncall_cpu_ms_edge`` (this process: the pool), ``_supervisor``, ``_zygote`` (its
  forks), ``_calls`` (the call processes, exits included); ``fncall_faults_per_call`` and
  ``fncall_zygote_faults_per_call``: minor page faults (pages copied after a fork, mostly).
  ``load1``: the host's load average at the end (the figures are CPU time: a loaded host
  inflates them).
- ``fncall_per_s``: ``n_conc`` calls at once (``call_many``) on this host's cores.
- ``sandbox_call_p50_ms``: create a container sandbox of the same image, exec
  ``python3 -c`` with the same snippet (numpy imported by that process), destroy;
  ``fncall_vs_sandbox_ratio`` = ``fncall_pool_p50_ms / sandbox_call_p50_ms``.
- ``fncall_isolation_cases``: how many isolation cases ran; each tries to leave state
  for the next call or read another's, and must be refused. A case that leaks makes
  :func:`measure` raise (:class:`IsolationLeak`), so no figure is reported for a pool
  that leaks.

Must never: leave a sandbox behind (the pool and the sandbox phase clean up on error).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dsec.bench.stats import percentile

Progress = Callable[[str], None]
PACKAGES = ("python3", "python3-numpy")
SNIPPET = "import numpy as np\ndef main(a, b):\n    return float(np.dot(np.asarray(a), np.asarray(b)))\n"
ARGS = ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
PACED_GAP_S = 0.02
"""The ``*_paced_*`` figures leave this long between calls (an agent's think time): the
call alone, not the rate at which a worker re-forks; back to back, a 2-core host is
bound by the forks and exits of the processes."""


class IsolationLeak(AssertionError):
    """An isolation case saw what it must not: the figures of such a pool mean nothing."""


def _quiet(_msg: str) -> None:
    return None


# ----------------------------------------------------------------- images ----


def python_rootfs(cache: Path, packages: Sequence[str] = PACKAGES, say: Progress = _quiet) -> Path:
    """A Debian bookworm minbase tree with ``packages``, made once with debootstrap and cached."""
    from dsec.images.debootstrap import find_mirror, run_debootstrap, scrub_build_host, slim_rootfs

    target = cache / ("debian-bookworm-" + "-".join(sorted(packages)))
    done = target / ".dsec-complete"
    if done.exists():
        return target
    if target.exists():
        shutil.rmtree(target)
    say(f"building a Debian rootfs with {', '.join(packages)} in {target} (debootstrap, once)")
    cache.mkdir(parents=True, exist_ok=True)
    run_debootstrap(target, suite="bookworm", variant="minbase", packages=packages, mirror=find_mirror("bookworm"))
    slim_rootfs(target)
    scrub_build_host(target)  # the build machine's hostname and resolver out, a neutral /etc/hosts in
    done.write_text("ok\n")
    return target


def python_layer(store: Any, cache: Path, *, name: str = "pyfn", tag: str = "bench",
                 packages: Sequence[str] = PACKAGES, say: Progress = _quiet) -> str:
    """``name:tag`` in ``store``: the EROFS layer of :func:`python_rootfs`, built once into a
    layer store under ``cache`` and imported from there (a copy of one file)."""
    from dsec.errors import LayerNotFound
    from dsec.images.build import build_from_dir
    from dsec.images.store import LocalLayerStore

    ref = f"{name}:{tag}"
    with contextlib.suppress(LayerNotFound):
        store.resolve(ref)
        return ref
    cached = LocalLayerStore(cache / "fncall-layers")
    key = "py-" + "-".join(sorted(p.replace("python3-", "") for p in packages if p != "python3"))[:100]
    try:
        layer = cached.resolve(f"{key or 'py'}:bookworm")
    except LayerNotFound:
        root = python_rootfs(cache, packages, say)
        say(f"making the EROFS layer of {root}")
        layer = build_from_dir(cached, root, name=key or "py", tag="bookworm", kind="base")
    store.add_erofs(Path(cached.blob_path(layer.digest)), name=name, tag=tag, kind="base")
    return ref


# -------------------------------------------------------------- isolation ----

# Each case: a first call that tries to leave or take something, and a check, run after it
# (or beside it), that must find nothing. "refused" lists what the first call was refused.
ISOLATION_CASES: dict[str, tuple[str, str]] = {
    "tmp_file": (
        "import os\n"
        "def main():\n"
        "    out = []\n"
        "    for p in ('/tmp/x', '/var/tmp/x', '/dev/shm/x', '/x', '/fncall/x'):\n"
        "        try:\n"
        "            open(p, 'w').write('leak')\n"
        "            out.append(p)\n"
        "        except OSError:\n"
        "            pass\n"
        "    open('mine', 'w').write('leak')\n"
        "    return out\n",
        "import os\n"
        "def main():\n"
        "    seen = [p for p in ('/tmp/x', '/var/tmp/x', '/dev/shm/x', '/x', '/fncall/x') if os.path.exists(p)]\n"
        "    return seen + os.listdir('.')\n",
    ),
    "global": (
        "import json, builtins, sys\n"
        "def main():\n"
        "    json.LEAK = 1; builtins.LEAK = 1; sys.modules['os'].LEAK = 1\n"
        "    globals()['LEAK'] = 1\n"
        "    return []\n",
        "import json, builtins, os\n"
        "def main():\n"
        "    seen = [m.__name__ for m in (json, builtins, os) if hasattr(m, 'LEAK')]\n"
        "    return seen + (['globals'] if 'LEAK' in globals() else [])\n",
    ),
    "env": (
        "import os\n"
        "def main():\n"
        "    os.environ['LEAK'] = '1'; os.putenv('LEAK2', '1')\n"
        "    return []\n",
        "import os\n"
        "def main():\n"
        "    return [k for k in ('LEAK', 'LEAK2') if k in os.environ or os.getenv(k)]\n",
    ),
    "background_process": (
        "import os, subprocess\n"
        "def main():\n"
        "    p = subprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        if os.fork() == 0:\n"
        "            import time; time.sleep(1000)\n"
        "        os._exit(0)\n"
        "    return [p.pid]\n",
        "import os\n"
        "def main(pids):\n"
        "    alive = []\n"
        "    for pid in os.listdir('/proc'):\n"
        "        if pid.isdigit():\n"
        "            try:\n"
        "                cmd = open(f'/proc/{pid}/cmdline', 'rb').read()\n"
        "            except OSError:\n"
        "                continue\n"
        "            if b'sleep' in cmd or int(pid) in pids:\n"
        "                state = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0]\n"
        "                alive.append([int(pid), cmd.decode(errors='replace'), state])\n"
        "    return alive\n",
    ),
    "template_memory": (
        "import os\n"
        "def main():\n"
        "    out = []\n"
        "    for pid in {os.getppid(), 1, 2, 3, 4, 5}:\n"
        "        try:\n"
        "            with open(f'/proc/{pid}/mem', 'r+b') as f:\n"
        "                out.append(pid)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return out\n",
        "def main():\n"
        "    return []\n",
    ),
    "site_packages": (
        "import os, json, numpy\n"
        "def main():\n"
        "    out = []\n"
        "    for d in ('/usr/lib/python3/dist-packages', os.path.dirname(json.__file__),\n"
        "              os.path.dirname(numpy.__file__), '/usr/local/lib/python3.11/dist-packages',\n"
        "              '/opt/dsec-fncall'):\n"
        "        try:\n"
        "            open(os.path.join(d, 'fncall_leak.py'), 'w').write('LEAK = 1')\n"
        "            out.append(d)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return out\n",
        "def main():\n"
        "    try:\n"
        "        import fncall_leak\n"
        "        return ['imported']\n"
        "    except ImportError:\n"
        "        return []\n",
    ),
    "ipc": (
        "import ctypes\n"
        "def main():\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    out = []\n"
        "    if libc.shmget(0x4c45414b, 4096, 0o1666) >= 0: out.append('shm')\n"
        "    if libc.semget(0x4c45414b, 1, 0o1666) >= 0: out.append('sem')\n"
        "    if libc.msgget(0x4c45414b, 0o1666) >= 0: out.append('msg')\n"
        "    return out\n",
        "import ctypes\n"
        "def main():\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    return ['shm'] if libc.shmget(0x4c45414b, 0, 0) >= 0 else []\n",
    ),
}

CONCURRENT_VICTIM = (
    "import os, time\n"
    "def main(secret):\n"
    "    os.environ['SECRET'] = secret\n"
    "    keep = secret * 3\n"
    "    time.sleep(1.5)\n"
    "    return 'alive:' + str(len(keep))\n"
)
CONCURRENT_ATTACKER = (
    "import os, signal, ctypes, time\n"
    "def main(secret):\n"
    "    time.sleep(0.5)\n"
    "    me = os.getuid()\n"
    "    got = []\n"
    "    libc = ctypes.CDLL(None, use_errno=True)\n"
    "    for pid in os.listdir('/proc'):\n"
    "        if not pid.isdigit() or int(pid) == os.getpid():\n"
    "            continue\n"
    "        pid = int(pid)\n"
    "        try:\n"
    "            uid = int(open(f'/proc/{pid}/status').read().split('Uid:')[1].split()[0])\n"
    "        except (OSError, IndexError):\n"
    "            continue\n"
    "        if uid == me:\n"
    "            continue\n"
    "        for name in ('environ', 'cmdline', 'mem', 'maps', 'cwd/x'):\n"
    "            try:\n"
    "                data = open(f'/proc/{pid}/{name}', 'rb').read()\n"
    "                if secret.encode() in data: got.append(f'{name}:{pid}')\n"
    "            except OSError:\n"
    "                pass\n"
    "        try:\n"
    "            os.kill(pid, signal.SIGKILL); got.append(f'kill:{pid}')\n"
    "        except OSError:\n"
    "            pass\n"
    "        if libc.ptrace(16, pid, 0, 0) == 0: got.append(f'ptrace:{pid}')\n"
    "    return got\n"
)


async def run_isolation_cases(call: Callable[..., Any]) -> int:
    """Run every case through ``call(source, args)`` (an awaitable returning the call's value);
    raise :class:`IsolationLeak` naming the case that saw something. Returns how many ran."""
    n = 0
    for name, (first, check) in ISOLATION_CASES.items():
        left = await call(first, [])
        args = [left] if name == "background_process" else []
        seen = await call(check, args)
        if name == "background_process":
            if seen:
                raise IsolationLeak(f"{name}: processes of an earlier call still run: {seen}")
        elif left or seen:
            raise IsolationLeak(f"{name}: the first call was allowed {left!r}; the next saw {seen!r}")
        n += 1
    victim, attacker = await asyncio.gather(call(CONCURRENT_VICTIM, ["s3cr3t-fncall"]),
                                            call(CONCURRENT_ATTACKER, ["s3cr3t-fncall"]))
    if attacker or victim != "alive:" + str(len("s3cr3t-fncall") * 3):
        raise IsolationLeak(f"concurrent calls: the attacker got {attacker!r}; the victim returned {victim!r}")
    return n + 1


# ---------------------------------------------------------------- measure ----


def _proc_cpu_s(pid: int) -> float:
    """utime + stime + cutime + cstime of ``pid`` (its own and its reaped children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int) -> tuple[float, float, int, int]:
    """CPU seconds of ``pid`` itself and of its reaped children; its minor faults, theirs."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return (int(f[11]) + int(f[12])) / tck, (int(f[13]) + int(f[14])) / tck, int(f[7]), int(f[8])


def _cpu_split(supervisors: Sequence[int]) -> dict[str, float]:
    """CPU seconds used so far by this process (``edge``) and by the workers: each supervisor,
    its zygote, and the zygote's reaped children (``calls``: every call process, and their
    orphans: the zygote is their subreaper); minor faults of the zygote and of the calls."""
    out = {"edge": time.process_time(), "supervisor": 0.0, "zygote": 0.0, "calls": 0.0,
           "zygote_faults": 0.0, "call_faults": 0.0}
    for pid in supervisors:
        out["supervisor"] += _proc_cpu_s(pid)
        for task in os.listdir(f"/proc/{pid}/task"):
            for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                own, kids, flt, cflt = _proc_stat(int(child))
                out["zygote"] += own
                out["calls"] += kids
                out["zygote_faults"] += flt
                out["call_faults"] += cflt
    return out



async def _timed(n: int, one: Callable[[], Any], *, gap_s: float = 0.0) -> list[float]:
    out: list[float] = []
    for _ in range(n):
        if gap_s:
            await asyncio.sleep(gap_s)
        t = time.perf_counter()
        await one()
        out.append((time.perf_counter() - t) * 1000)
    return out


async def measure(pool: Any, container: Any, image: Any, *, n_seq: int = 300, n_conc: int = 2000,
                  n_sandbox: int = 20, sdk_call: Callable[..., Any] | None = None,
                  say: Progress = _quiet) -> dict[str, float]:
    """The figures of one run (see the module docstring). ``pool`` is a started
    :class:`~dsec.backends.fncall.pool.FnCallPool` with ``image`` configured (numpy
    preloaded), ``container`` the container backend for the sandbox-per-call baseline,
    ``sdk_call(source, args)`` an SDK ``fncall`` for the end-to-end figures."""
    from dsec.spec import ImageRef, SandboxSpec

    results: dict[str, float] = {}

    async def pool_call(source: str, args: Sequence[Any]) -> Any:
        return (await pool.call(image, source, list(args))).value

    say("warming up")
    for _ in range(20):
        await pool_call(SNIPPET, ARGS)
    say(f"fncall: {n_seq} calls one after another (pool)")
    lat = await _timed(n_seq, lambda: pool_call(SNIPPET, ARGS))
    results["fncall_pool_p50_ms"] = percentile(lat, 50)
    results["fncall_pool_p90_ms"] = percentile(lat, 90)
    results["fncall_pool_p99_ms"] = percentile(lat, 99)
    lat = await _timed(n_seq // 2, lambda: pool_call(SNIPPET, ARGS), gap_s=PACED_GAP_S)
    results["fncall_pool_paced_p50_ms"] = percentile(lat, 50)
    results["fncall_pool_paced_p90_ms"] = percentile(lat, 90)
    if sdk_call is not None:
        for _ in range(20):
            await sdk_call(SNIPPET, ARGS)
        say(f"fncall: {n_seq} calls one after another (SDK -> edge)")
        lat = await _timed(n_seq, lambda: sdk_call(SNIPPET, ARGS))
        results["fncall_sdk_p50_ms"] = percentile(lat, 50)
        results["fncall_sdk_p90_ms"] = percentile(lat, 90)
        results["fncall_sdk_p99_ms"] = percentile(lat, 99)
    results["fncall_p50_ms"] = results.get("fncall_sdk_p50_ms", results["fncall_pool_p50_ms"])
    results["fncall_p90_ms"] = results.get("fncall_sdk_p90_ms", results["fncall_pool_p90_ms"])

    say(f"fncall: {n_conc} calls at once")
    from dsec.spec.fncall import FnCall, FnResult

    sups = [w.supervisor_pid for w in pool.workers() if w.supervisor_pid]
    s0, t = _cpu_split(sups), time.perf_counter()
    outs = await pool.call_many(image, [FnCall(SNIPPET, ARGS)] * n_conc)
    dt = time.perf_counter() - t
    await asyncio.sleep(0.5)  # the last call processes exit and are reaped
    s1 = _cpu_split(sups)
    d = {k: s1[k] - s0[k] for k in s0}
    cpu = d["edge"] + d["supervisor"] + d["zygote"] + d["calls"]
    if cpu > 0:
        # What a call costs in CPU, host side (this process) and in its worker sandbox: on a
        # machine shared with other work, rate = cores / cpu per call is what it would do alone.
        results["fncall_cpu_ms_per_call"] = cpu / n_conc * 1000
        results["fncall_per_s_cpu_bound"] = (os.cpu_count() or 1) / (cpu / n_conc)
        for k in ("edge", "supervisor", "zygote", "calls"):
            results[f"fncall_cpu_ms_{k}"] = d[k] / n_conc * 1000
        results["fncall_faults_per_call"] = d["call_faults"] / n_conc
        results["fncall_zygote_faults_per_call"] = d["zygote_faults"] / n_conc
    bad = [o for o in outs if not isinstance(o, FnResult)]
    if bad:
        raise RuntimeError(f"{len(bad)} of {n_conc} concurrent calls failed, e.g. {bad[0]!r}")
    results["fncall_per_s"] = n_conc / dt
    results["fncall_conc_n"] = float(n_conc)
    results["cpus"] = float(os.cpu_count() or 1)

    say(f"sandbox per call: {n_sandbox} x create + exec python3 -c + destroy")
    ref = image if isinstance(image, ImageRef) else ImageRef(base=str(image))
    spec = SandboxSpec(image=ref)
    cmd = ["python3", "-c", SNIPPET + f"import sys\nsys.stdout.write(repr(main(*{json.dumps(ARGS)})))\n"]
    sb_lat: list[float] = []
    for _ in range(n_sandbox):
        t = time.perf_counter()
        rec = await container.create(spec)
        try:
            r = await container.exec(rec.id, cmd, timeout=60)
            if r.exit_code != 0:
                raise RuntimeError(f"the baseline's snippet failed: {r.stderr[-500:]!r}")
        finally:
            await container.destroy(rec.id)
        sb_lat.append((time.perf_counter() - t) * 1000)
    results["sandbox_call_p50_ms"] = percentile(sb_lat, 50)
    results["fncall_vs_sandbox_ratio"] = results["fncall_pool_p50_ms"] / results["sandbox_call_p50_ms"]

    say("isolation cases")
    results["fncall_isolation_cases"] = float(await run_isolation_cases(pool_call))
    results["load1"] = os.getloadavg()[0]
    return results


async def measure_sdk(call: Callable[..., Any], *, n_seq: int = 300) -> dict[str, float]:
    """``fncall_sdk_*``: ``call(source, args)`` one after another (an SDK client's fncall)."""
    for _ in range(20):
        await call(SNIPPET, ARGS)
    lat = await _timed(n_seq, lambda: call(SNIPPET, ARGS))
    paced = await _timed(n_seq // 2, lambda: call(SNIPPET, ARGS), gap_s=PACED_GAP_S)
    return {"fncall_sdk_p50_ms": percentile(lat, 50), "fncall_sdk_p90_ms": percentile(lat, 90),
            "fncall_sdk_p99_ms": percentile(lat, 99), "fncall_sdk_paced_p50_ms": percentile(paced, 50),
            "fncall_sdk_paced_p90_ms": percentile(paced, 90)}


async def _sdk_figures(url: str, token: str, image: str, n_seq: int) -> dict[str, float]:
    from dsec.sdk import AsyncClient

    async with AsyncClient(url, token) as c:
        async def one(source: str, args: Sequence[Any]) -> Any:
            return (await c.fncall(image, source, args=list(args))).value

        return await measure_sdk(one, n_seq=n_seq)


def sdk_figures(url: str, token: str, image: str, *, n_seq: int) -> dict[str, float]:
    """:func:`measure_sdk` from a process of its own, as a trainer calls an edge (not a
    thread of the edge's process, whose interpreter lock it would share)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "dsec.bench.fncall", "--sdk-client", url, image, str(n_seq)],
                          input=token, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the SDK client failed: {proc.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return figures


def run(*, quick: bool = False, state_dir: Path | None = None, say: Progress = print) -> dict[str, float]:
    """The whole bench (``dsec bench fncall``): an edge of its own (container + fncall
    backends, numpy preloaded) on a private event loop, the pool's figures measured on that
    loop, the SDK's from this thread's loop over loopback HTTP, then clean-up."""
    import secrets
    import tempfile

    from pydantic import ValidationError

    from dsec.backends.container.config import ContainerConfig
    from dsec.backends.fncall.backend import FnCallBackend
    from dsec.backends.fncall.config import FnCallConfig, FnCallImage
    from dsec.edge.config import EdgeConfig
    from dsec.edge.testing import EdgeThread, prepare_busybox
    from dsec.images.store import LocalLayerStore
    from dsec.spec import ImageRef

    base = Path(state_dir or os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec"))
    cache = base / "cache"
    n_seq, n_conc, n_sandbox = (100, 300, 5) if quick else (300, 2000, 20)
    with tempfile.TemporaryDirectory(prefix="dsec-bench-fncall-") as tmp:
        state = Path(tmp) / "state"
        store = LocalLayerStore(state / "layers")
        try:
            ref = python_layer(store, cache, say=say)
        finally:
            store.close()
        prepare_busybox(state)
        image = ImageRef(base=ref)
        fncfg = FnCallConfig(images=(FnCallImage(image=image, preload=("numpy",), concurrency=4, spare=4),))
        common: dict[str, Any] = {"edge_id": "bfn", "cluster_key": secrets.token_bytes(32), "port": 0,
                                  "state_dir": state, "run_dir": Path(tmp) / "run", "destroy_on_shutdown": True,
                                  "runtime_name": f"bfn{os.getpid() % 100000}"}
        injected = False
        try:
            both: list[Any] = [ContainerConfig(), fncfg]
            cfg = EdgeConfig(**common, backends=both)
        except ValidationError:  # EdgeConfig's backend union does not list fncall yet: add it by hand
            cfg = EdgeConfig(**common)
            injected = True
        edge = EdgeThread(cfg).start()
        try:
            kinds = edge.service.backends.by_kind
            if injected:
                b = FnCallBackend(fncfg, name=f"{cfg.runtime}-fncall", host=kinds["container"])
                edge.call(b.start(), timeout=600)
                kinds["fncall"] = b
            backend = kinds["fncall"]
            say("fncall: the pool, on the edge's loop")
            results = edge.call(measure(backend.pool, kinds["container"], image, n_seq=n_seq, n_conc=n_conc,
                                        n_sandbox=n_sandbox, say=say), timeout=3600)

            say(f"fncall: {n_seq} calls one after another (SDK in another process -> edge over loopback HTTP)")
            results.update(sdk_figures(edge.url, edge.admin_token(), ref, n_seq=n_seq))
            results["fncall_p50_ms"] = results["fncall_sdk_p50_ms"]
            results["fncall_p90_ms"] = results["fncall_sdk_p90_ms"]
            return results
        finally:
            edge.stop(destroy_all=True)


if __name__ == "__main__":  # python -m dsec.bench.fncall [--quick] [--json PATH]
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sdk-client", nargs=3, metavar=("URL", "IMAGE", "N"), help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.sdk_client:  # the SDK side of run(): the token on stdin, the figures as JSON on stdout
        import sys

        url, img, n = ns.sdk_client
        print(json.dumps(asyncio.run(_sdk_figures(url, sys.stdin.read().strip(), img, int(n)))))
        raise SystemExit(0)
    figures = run(quick=ns.quick)
    for k, v in sorted(figures.items()):
        print(f"{k:28} {v:10.3f}")
    if ns.json:
        ns.json.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
