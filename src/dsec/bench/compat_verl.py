"""``dsec bench compat --phase sf_verl``: verl's worst case against DSec's SandboxFusion API.

verl's reward code calls SandboxFusion from a thread pool (``max(32, 5 x cpus)`` calls in
flight), each call with a request timeout of ``compile_timeout + run_timeout + 10`` s,
retrying a 504 twice after 1 s and then 2 s and giving up on anything else. Its worst
case is a batch whose every call runs into its run timeout: each holds its sandbox the
whole timeout. This phase plays that batch with a client that follows the same policy
(written here, not verl's code):

- ``sf_verl_all_timeout_ok_runs`` of ``sf_verl_runs``: runs in which every one of
  ``sf_verl_calls`` calls (a program that sleeps past a 10 s run timeout, 32 in flight)
  was answered ``TimeLimitExceeded``; ``sf_verl_api_errors``: calls that ended as verl's
  "API Call Failed" over all runs (must be 0); ``sf_verl_504s``: the 504s its retries
  absorbed; ``sf_verl_run_s``: the seconds each run took;
- ``sf_verl_short_errors`` of ``sf_verl_short_calls``: a mix of short calls (a trivial
  program, 64 in flight, the same client) that did not answer Success with the right
  output.
"""

from __future__ import annotations

import concurrent.futures
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from dsec.bench.compat_kit import Say, _quiet, all_in_one, toolchain_cache

IN_FLIGHT = 32
"""verl's pool: max(32, 5 x cpus) calls at once (32 on a 2-core host)."""
RETRIES = 3
API_SLACK_S = 10
SLEEPER = "import time\ntime.sleep(30)\nprint('never')\n"
SHORT = "print(sum(range(100)))\n"


def verl_call(endpoint: str, code: str, *, compile_timeout: int = 10, run_timeout: int = 10,
              language: str = "python") -> tuple[dict[str, Any] | None, str | None, int]:
    """One call as verl's ``call_sandbox_api`` makes it: (answer, error, 504s seen)."""
    import requests

    body = json.dumps({"compile_timeout": compile_timeout, "run_timeout": run_timeout, "code": code, "stdin": "",
                       "language": language, "files": {}, "fetch_files": []})
    timeout = compile_timeout + run_timeout + API_SLACK_S
    busy = 0
    error = None
    for attempt in range(RETRIES):
        try:
            r = requests.post(endpoint, data=body, timeout=timeout,
                              headers={"Content-Type": "application/json", "Accept": "application/json"})
        except requests.RequestException as exc:
            return None, f"API Request Error: {exc}", busy
        if r.status_code == 504:
            busy += 1
            error = f"Gateway Timeout (504) on attempt {attempt + 1}/{RETRIES}"
            if attempt < RETRIES - 1:
                time.sleep(1 * (attempt + 1))
            continue
        if r.status_code >= 400:
            return None, f"HTTP {r.status_code}: {r.text[:200]}", busy
        return r.json(), None, busy
    return None, error, busy


def _batch(endpoint: str, n: int, in_flight: int, code: str) -> list[tuple[dict[str, Any] | None, str | None, int]]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=in_flight) as pool:
        return list(pool.map(lambda _i: verl_call(endpoint, code), range(n)))


def measure_verl(url: str, token: str, *, quick: bool = False, say: Say = _quiet) -> dict[str, Any]:
    endpoint = f"{url}/sandboxfusion/{token}/run_code"
    runs, calls, short = (1, 40, 200) if quick else (5, 100, 1000)
    out: dict[str, Any] = {"sf_verl_runs": runs, "sf_verl_calls": calls, "sf_verl_in_flight": IN_FLIGHT}
    ok_runs = api_errors = busy = 0
    seconds: list[float] = []
    statuses: dict[str, int] = {}
    for i in range(runs):
        say(f"sf_verl: run {i + 1}/{runs}: {calls} calls past a 10 s run timeout, {IN_FLIGHT} in flight, "
            "verl's retry policy")
        t0 = time.monotonic()
        got = _batch(endpoint, calls, IN_FLIGHT, SLEEPER)
        seconds.append(round(time.monotonic() - t0, 1))
        good = 0
        for answer, error, b in got:
            busy += b
            if error is not None or answer is None:
                api_errors += 1
                statuses["api_error"] = statuses.get("api_error", 0) + 1
                continue
            status = str((answer.get("run_result") or {}).get("status"))
            statuses[status] = statuses.get(status, 0) + 1
            good += status == "TimeLimitExceeded"
        ok_runs += good == calls
        say(f"sf_verl: run {i + 1}: {good}/{calls} TimeLimitExceeded in {seconds[-1]} s")
    out["sf_verl_all_timeout_ok_runs"] = ok_runs
    out["sf_verl_api_errors"] = api_errors
    out["sf_verl_504s"] = busy
    out["sf_verl_run_s"] = seconds
    out["sf_verl_statuses"] = statuses
    say(f"sf_verl: {short} short calls, 64 in flight, the same client")
    got = _batch(endpoint, short, 64, SHORT)
    bad = sum(1 for answer, error, _b in got if error is not None or answer is None
              or answer.get("status") != "Success" or (answer.get("run_result") or {}).get("stdout") != "4950\n")
    out["sf_verl_short_calls"] = short
    out["sf_verl_short_errors"] = bad
    out["sf_verl_short_504s"] = sum(b for _a, _e, b in got)
    return out


def run(quick: bool = False, say: Say = _quiet) -> dict[str, Any]:
    """The phase with its own all-in-one (the python toolchain built once, then cached)."""
    from dsec.images.store import LocalLayerStore
    from dsec.images.toolchains import build_toolchains, copy_toolchains

    cache = LocalLayerStore(toolchain_cache())
    try:
        build_toolchains(cache, ("python",), progress=None)
        with tempfile.TemporaryDirectory(prefix="dsec-bench-verl-") as tmp:
            work = Path(tmp)
            store = LocalLayerStore(work / "layers")
            try:
                copy_toolchains(cache, store, ("python",))
            finally:
                store.close()
            with all_in_one(work, say, "sf_verl") as (url, token, _pid):
                return measure_verl(url, token, quick=quick, say=say)
    finally:
        cache.close()


__all__ = ["measure_verl", "run", "verl_call"]
