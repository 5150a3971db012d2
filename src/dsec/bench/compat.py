"""``dsec bench compat``: clients of other sandbox services, unchanged, against DSec.

Figures, not assertions. The suite is a list of **phases** (:data:`PHASES`); each runs with
its own all-in-one (``dsec up`` in a temporary data directory, as a user would run it) and
returns flat keys, merged in order. A phase that fails leaves ``<phase>_error`` and the
others still run. To add one: write ``run(*, quick, say) -> dict`` in its own module and
append a :class:`Phase`.

**sandboxfusion** (this module): SandboxFusion's API served by the control plane, called
through the released ``sandbox-fusion`` client exactly as a user calls it (``run_code``: one
HTTP request per call, no kept-alive session):

- ``sf_run_code_python_p50_ms`` / ``_p90_ms``: ``n_seq`` python calls one after another
  (a sandbox each: create, write the code, run, answer; the delete happens after the
  answer), snippet :data:`PY`;
- ``sf_run_code_cpp_p50_ms`` / ``_p90_ms``: the same for a C++ snippet (:data:`CPP`):
  ``g++`` compile stage, then the run stage;
- ``sf_run_code_per_s``: ``n_conc`` python calls with 64 in flight (the client's own
  ``run_concurrent``, threads, as verl's reward workers do; with the client's own retries,
  as a user calls it); ``sf_errors``: calls that raised after those retries or did not
  answer Success with the right output (must be 0); ``sf_client_retries``: the retries the
  client made (each a 504: no sandbox free within ``queue_timeout_s``);
  ``sf_run_code_64_p50_ms``: their latency; ``sf_server_cpu_ms_per_call``: CPU of the
  all-in-one's process tree (control plane, edge, spawner, the sandboxes' processes) per
  call in that phase, and ``sf_per_s_cpu_bound`` = cores / that (what the host's CPUs allow
  when nothing else runs: independent of other load); ``sf_client_cpu_ms_per_call``: the
  client's (this process's) CPU per call;
- ``sf_subprocess_python_p50_ms`` / ``sf_subprocess_cpp_p50_ms``: the same snippets run as
  a local subprocess on this host (``python3 main.py``; ``g++`` then ``./main``, in a fresh
  directory), which is what SandboxFusion's own server does per call (no per-call
  isolation); each sample right after one of DSec's (alternating), so
  ``sf_vs_subprocess_ratio`` (python) and ``sf_vs_subprocess_cpp_ratio`` compare like with
  like on a host whose load changes;
- ``load1``: the host's load average at the end (a loaded host inflates every figure).

**sf_verl**: :mod:`dsec.bench.compat_verl` (verl's worst case: ``sf_verl_all_timeout_ok_runs``).

**sf_languages**: :mod:`dsec.bench.compat_languages` (``sf_languages_served``, each
language's p50 beside a local run, the toolkit layers' sizes).

**swerex**: :mod:`dsec.bench.compat_swerex` (its module says what it measures).

Must never: leave a sandbox behind (each all-in-one stops with Ctrl-C, destroying them).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.bench.compat_kit import Say, _alternating, _quiet, all_in_one, toolchain_cache
from dsec.bench.stats import percentile

SF_TOOLCHAINS = ("python", "cpp")
PY = "total = sum(i * i for i in range(1000))\nprint(total)\n"
CPP = ("#include <cstdio>\nint main() { long total = 0; for (long i = 0; i < 1000; i++) total += i * i;"
       " std::printf(\"%ld\\n\", total); return 0; }\n")
EXPECTED = f"{sum(i * i for i in range(1000))}\n"
IN_FLIGHT = 64


@dataclass(frozen=True)
class Phase:
    name: str
    run: Callable[[bool, Say], dict[str, Any]]
    """``run(quick, say)``: the phase's flat keys, with its own all-in-one."""
    about: str


# ------------------------------------------------------------ sandboxfusion ----


def _client() -> Any:
    try:
        import sandbox_fusion  # type: ignore[import-untyped]
    except ImportError:
        raise RuntimeError("the sandboxfusion phase calls DSec with the released client: "
                           "pip install sandbox-fusion==0.3.7 (in the dev extra)") from None
    return sandbox_fusion


def _sf_call_ms(sf: Any, ep: str, language: str, code: str) -> float:
    t0 = time.perf_counter()
    r = sf.run_code(sf.RunCodeRequest(code=code, language=language), endpoint=ep, max_attempts=1)
    ms = (time.perf_counter() - t0) * 1000
    if r.status != sf.RunStatus.Success or r.run_result.stdout != EXPECTED:
        raise RuntimeError(f"{language}: unexpected answer {r}")
    return ms


def _subprocess_call_ms(argv_compile: Sequence[str] | None, argv_run: Sequence[str], source: str, code: str) -> float:
    """The snippet in a fresh directory, as SandboxFusion's server runs a call (subprocesses)."""
    with tempfile.TemporaryDirectory(prefix="dsec-bench-sf-") as tmp:
        t0 = time.perf_counter()
        Path(tmp, source).write_text(code)
        out = b""
        for argv in (argv_compile, argv_run):
            if argv is None:
                continue
            r = subprocess.run(list(argv), cwd=tmp, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.decode()[-300:]}")
            out = r.stdout
        ms = (time.perf_counter() - t0) * 1000
    if out.decode() != EXPECTED:
        raise RuntimeError(f"{' '.join(argv_run)} printed {out!r}")
    return ms


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its live descendants, with what each has reaped (so the
    sandboxes' commands, reaped by the spawner, count too)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
        cpu[int(entry)] = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo.extend(children.get(p, ()))
    return total


class _Retries(logging.Handler):
    """Counts the retries the released client makes (it logs each before sleeping)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "will retry" in record.getMessage():
            self.count += 1


def _concurrent(sf: Any, ep: str, n: int) -> tuple[float, int, int, list[float]]:
    """``n`` python calls, IN_FLIGHT at a time, through the client with its own retries (as
    a user calls it): (calls/s, errors, the client's retries, latencies)."""
    lat: list[float] = []

    def one() -> bool:
        t0 = time.perf_counter()
        try:
            r = sf.run_code(sf.RunCodeRequest(code=PY, language="python"), endpoint=ep)
        except Exception:
            return False
        lat.append((time.perf_counter() - t0) * 1000)
        return bool(r.status == sf.RunStatus.Success and r.run_result.stdout == EXPECTED)

    logger = logging.getLogger("sandbox_fusion.client")
    retries = _Retries()
    level, propagate = logger.level, logger.propagate
    logger.addHandler(retries)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # counted, not printed
    try:
        t0 = time.perf_counter()
        oks = sf.run_concurrent_pure([one] * n, concurrency=IN_FLIGHT)
        wall = time.perf_counter() - t0
    finally:
        logger.removeHandler(retries)
        logger.setLevel(level)
        logger.propagate = propagate
    return n / wall, sum(1 for ok in oks if not ok), retries.count, lat


def measure_sandboxfusion(url: str, token: str, *, quick: bool = False, say: Say = _quiet,
                          server_pid: int | None = None) -> dict[str, Any]:
    """The sandboxfusion phase against a DSec that runs (the python and cpp toolchains on its
    edges); ``server_pid``: its process (``dsec up``), for the CPU per call."""
    sf = _client()
    ep = f"{url}/sandboxfusion/{token}"
    n_seq, n_cpp, n_conc = (20, 10, 128) if quick else (100, 40, 640)
    res: dict[str, Any] = {"sf_quick": quick, "sf_in_flight": IN_FLIGHT, "sf_calls_concurrent": n_conc}
    # Debian's python3, the interpreter the sandboxes run (a pyenv shim would time a shell script)
    python3 = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    say(f"sandboxfusion: run_code python x{n_seq} through the sandbox-fusion client, one after another, "
        f"each followed by the same snippet as a local subprocess ({python3})")
    py, sub = _alternating(n_seq, lambda: _sf_call_ms(sf, ep, "python", PY),
                           lambda: _subprocess_call_ms(None, [python3, "main.py"], "main.py", PY))
    res["sf_run_code_python_p50_ms"] = round(percentile(py, 50), 2)
    res["sf_run_code_python_p90_ms"] = round(percentile(py, 90), 2)
    res["sf_subprocess_python_p50_ms"] = round(percentile(sub, 50), 2)
    res["sf_vs_subprocess_ratio"] = round(res["sf_run_code_python_p50_ms"] / res["sf_subprocess_python_p50_ms"], 2)
    gpp = shutil.which("g++")
    say(f"sandboxfusion: run_code cpp x{n_cpp} (compile + run)" + (", each followed by g++ and ./main here" if gpp else
                                                                 " (no g++ on this host: no subprocess baseline)"))
    if gpp is None:
        (cpp,) = _alternating(n_cpp, lambda: _sf_call_ms(sf, ep, "cpp", CPP))
        res["sf_subprocess_cpp_p50_ms"] = None
    else:
        cpp, sub_cpp = _alternating(
            n_cpp, lambda: _sf_call_ms(sf, ep, "cpp", CPP),
            lambda: _subprocess_call_ms([gpp, "-std=c++17", "main.cpp", "-o", "main"], ["./main"], "main.cpp", CPP))
        res["sf_subprocess_cpp_p50_ms"] = round(percentile(sub_cpp, 50), 2)
    res["sf_run_code_cpp_p50_ms"] = round(percentile(cpp, 50), 2)
    res["sf_run_code_cpp_p90_ms"] = round(percentile(cpp, 90), 2)
    if res["sf_subprocess_cpp_p50_ms"]:
        res["sf_vs_subprocess_cpp_ratio"] = round(res["sf_run_code_cpp_p50_ms"] / res["sf_subprocess_cpp_p50_ms"], 2)
    say(f"sandboxfusion: {n_conc} python calls, {IN_FLIGHT} in flight")
    cpu0 = tree_cpu_s(server_pid) if server_pid else None
    me0 = time.process_time()
    rate, errors, retries, lat = _concurrent(sf, ep, n_conc)
    me = time.process_time() - me0
    if cpu0 is not None and server_pid:
        time.sleep(1.0)  # the last deletes (after the answers) belong to these calls too
        server = tree_cpu_s(server_pid) - cpu0
        res["sf_server_cpu_ms_per_call"] = round(server / n_conc * 1000, 2)
        res["sf_per_s_cpu_bound"] = round((os.cpu_count() or 1) / (server / n_conc), 1) if server > 0 else None
    res["sf_client_cpu_ms_per_call"] = round(me / n_conc * 1000, 2)
    res["sf_run_code_per_s"] = round(rate, 2)
    res["sf_errors"] = errors
    res["sf_client_retries"] = retries
    res["sf_run_code_64_p50_ms"] = round(percentile(lat, 50), 2) if lat else None
    return res


def run_sandboxfusion(quick: bool, say: Say) -> dict[str, Any]:
    """The sandboxfusion phase with its own all-in-one (toolchains built once, then cached)."""
    from dsec.images.store import LocalLayerStore
    from dsec.images.toolchains import build_toolchains, copy_toolchains

    _client()  # before anything slow
    cache = LocalLayerStore(toolchain_cache())
    try:
        built = build_toolchains(cache, SF_TOOLCHAINS, progress=None)
        if any(b.built for b in built):
            say(f"sandboxfusion: built the toolchains {', '.join(b.toolchain for b in built if b.built)} "
                f"into {toolchain_cache()}")
        with tempfile.TemporaryDirectory(prefix="dsec-bench-sf-") as tmp:
            work = Path(tmp)
            store = LocalLayerStore(work / "layers")
            try:
                copy_toolchains(cache, store, SF_TOOLCHAINS)
            finally:
                store.close()
            with all_in_one(work, say, "sandboxfusion") as (url, token, pid):
                return measure_sandboxfusion(url, token, quick=quick, say=say, server_pid=pid)
    finally:
        cache.close()


def _run_languages(quick: bool, say: Say) -> dict[str, Any]:
    from dsec.bench import compat_languages

    return compat_languages.run(quick, say)


def _run_verl(quick: bool, say: Say) -> dict[str, Any]:
    from dsec.bench import compat_verl

    return compat_verl.run(quick, say)


def _run_swerex(quick: bool, say: Say) -> dict[str, Any]:
    from dsec.bench import compat_swerex

    return compat_swerex.run(quick=quick, say=say)


PHASES: tuple[Phase, ...] = (
    Phase("sandboxfusion", run_sandboxfusion, "SandboxFusion's API through its released client; vs a local subprocess"),
    Phase("sf_languages", _run_languages, "every SandboxFusion language DSec serves: a trivial program's p50 beside a "
          "local run of the same toolchain; the toolkit layers' sizes"),
    Phase("sf_verl", _run_verl, "verl's worst case: 100 calls past a 10 s run timeout, 32 in flight, verl's "
          "retry policy, 5 runs; and 1,000 short calls at 64 in flight"),
    Phase("swerex", _run_swerex, "SWE-ReX's own test suite against DSecRuntime; run_in_session vs swerex-remote"),
)


def run(*, quick: bool = False, phases: Sequence[str] | None = None, say: Say = _quiet) -> dict[str, Any]:
    chosen = [p for p in PHASES if not phases or p.name in phases]
    unknown = sorted(set(phases or ()) - {p.name for p in PHASES})
    if unknown:
        raise ValueError(f"unknown phase {unknown[0]!r}: choose from {', '.join(p.name for p in PHASES)}")
    results: dict[str, Any] = {"quick": quick, "phases": ",".join(p.name for p in chosen)}
    for phase in chosen:
        t0 = time.monotonic()
        try:
            results.update(phase.run(quick, say))
        except Exception as exc:
            say(f"{phase.name}: failed: {exc}")
            results[f"{phase.name}_error"] = f"{type(exc).__name__}: {exc}"[:500]
        results[f"{phase.name}_s"] = round(time.monotonic() - t0, 1)
    results["load1"] = round(os.getloadavg()[0], 2)
    return results
