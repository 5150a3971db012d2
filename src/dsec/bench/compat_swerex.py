"""``dsec bench compat``'s SWE-ReX phase: SWE-ReX's own test suite against DSecRuntime, and
what one ``run_in_session`` costs, beside SWE-ReX's own server on this host (same run).

- **The suite**: ``tests/test_execution.py`` of the released swe-rex sdist (the version
  :data:`dsec.compat.swerex.SWEREX_VERSION` pins, fetched with pip), with
  ``swerex_suite_conftest.py`` as its conftest: each test gets a DSecRuntime over a fresh
  sandbox of a Debian image with python and less (its interactive tests start ``python``
  and ``less``). Every test runs; none is skipped. The ones that cannot apply are listed in
  :data:`NOT_APPLICABLE` with the reason, and the result says which failed beyond them.
- **Latency**: ``run_in_session(BashAction("echo hello"))`` in a DSecDeployment (a DSec
  pty, no server in the sandbox), and the same call through SWE-ReX's ``RemoteRuntime`` to
  ``swerex-remote`` started on this host (what its deployments run inside a container,
  here with no container around it: the floor of SWE-ReX's own path).

Keys: ``swerex_run_in_session_p50_ms`` (and p90), ``swerex_own_server_run_in_session_p50_ms``,
``swerex_suite_passed`` / ``swerex_suite_total`` / ``swerex_suite_xfailed`` /
``swerex_suite_not_applicable`` / ``swerex_suite_unexpected``, ``swerex_suite_s``.

Entry points: :func:`run` (its own all-in-one, for ``dsec bench compat`` to merge into its
results) and :func:`measure` (against a DSec that runs already). ``python -m
dsec.bench.compat_swerex [--quick] [--json PATH]`` runs :func:`run` alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.bench.compat_kit import Say, _quiet, all_in_one
from dsec.bench.stats import percentile

IMAGE = "swerex-debian:bookworm"
PACKAGES = ("python3", "python-is-python3", "less", "procps")
"""Debian bookworm minbase plus what SWE-ReX's tests start: ``python``, ``less``, ``ps``."""

SUITE_FILE = "test_execution.py"
NOT_APPLICABLE: dict[str, str] = {
    "test_read_write_file": "writes through the runtime, then reads the file back from the test host's own "
                            "filesystem (Path.read_text on the host): the sandbox's filesystem is not the host's",
    "test_read_large_file": "writes a 1 MiB file on the test host, then reads it through the runtime: the "
                            "sandbox's filesystem is not the host's",
}
"""Tests of the suite that cannot apply to a sandbox runtime, and why. They still run."""
NOT_OURS: dict[str, str] = {
    "test_server_dead": "builds a RemoteRuntime to a host that does not exist: it tests SWE-ReX's HTTP client "
                        "and passes without touching DSec",
}
"""Tests that pass whatever the runtime is (counted as passed; noted)."""
OTHER_FILES = {
    "test_server.py": "SWE-ReX's HTTP server (swerex-remote): DSec runs no server in the sandbox",
    "test_remote_deployment.py": "RemoteDeployment against swerex-remote",
    "test_local_deployment.py, test_local_runtime.py": "LocalDeployment / LocalRuntime on the test host itself",
    "test_docker_deployment.py, test_modal_deployment.py, test_fargate_deployment.py, test_get_deployment.py, "
    "test_dummy_deployment.py": "SWE-ReX's other deployments (docker, Modal, Fargate, the dummy) and its factory",
    "test_runtime.py": "unit tests of SWE-ReX's own bash-splitting helpers (DSecRuntime uses them as they are)",
}
"""The sdist's other test files: none of them takes the runtime from a fixture."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def state_dir() -> Path:
    return Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec"))


# ------------------------------------------------------------------ suite ----


def suite_dir(cache: Path, say: Say = _quiet) -> Path:
    """SWE-ReX's tests from its released sdist (``pip download``, cached under ``cache``),
    with this package's conftest beside them and a pytest.ini as SWE-ReX's own
    (``asyncio_mode = auto``)."""
    from dsec.compat.swerex import SWEREX_VERSION

    root = cache / f"swerex-suite-{SWEREX_VERSION}"
    tests = root / "tests"
    if not (tests / SUITE_FILE).exists():
        say(f"swerex: fetching swe-rex {SWEREX_VERSION}'s sdist for its tests")
        with tempfile.TemporaryDirectory(prefix="dsec-swerex-sdist-") as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            "-d", tmp, f"swe-rex=={SWEREX_VERSION}"], check=True, capture_output=True, timeout=300)
            sdists = list(Path(tmp).glob("swe_rex-*.tar.gz")) + list(Path(tmp).glob("swe-rex-*.tar.gz"))
            if not sdists:
                raise RuntimeError(f"pip download swe-rex=={SWEREX_VERSION} gave no sdist in {tmp}")
            staging = Path(tempfile.mkdtemp(prefix="tests-", dir=cache))
            with tarfile.open(sdists[0]) as tar:
                for m in tar.getmembers():
                    parts = Path(m.name).parts
                    if len(parts) == 3 and parts[1] == "tests" and m.isfile() and parts[2].endswith(".py"):
                        src = tar.extractfile(m)
                        assert src is not None
                        (staging / parts[2]).write_bytes(src.read())
            if not (staging / SUITE_FILE).exists():
                raise RuntimeError(f"swe-rex {SWEREX_VERSION}'s sdist has no tests/{SUITE_FILE}")
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tests, ignore_errors=True)
            staging.rename(tests)
    (tests / "__init__.py").write_text("")
    shutil.copyfile(Path(__file__).with_name("swerex_suite_conftest.py"), tests / "conftest.py")
    (root / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
                                     "xfail_strict = false\n")
    return root


@dataclass
class SuiteResult:
    outcomes: dict[str, str] = field(default_factory=dict)
    """test name -> passed / failed / error / skipped / xfailed."""
    messages: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    returncode: int = 0
    log: str = ""

    @property
    def passed(self) -> int:
        return sum(1 for o in self.outcomes.values() if o == "passed")

    @property
    def unexpected(self) -> dict[str, str]:
        """Failures that :data:`NOT_APPLICABLE` does not explain."""
        return {n: self.messages.get(n, o) for n, o in self.outcomes.items()
                if o in ("failed", "error", "skipped") and n not in NOT_APPLICABLE}

    def summary(self) -> dict[str, Any]:
        return {
            "swerex_suite_passed": self.passed,
            "swerex_suite_total": len(self.outcomes),
            "swerex_suite_xfailed": sum(1 for o in self.outcomes.values() if o == "xfailed"),
            "swerex_suite_not_applicable": sum(1 for n in self.outcomes if n in NOT_APPLICABLE),
            "swerex_suite_unexpected": len(self.unexpected),
            "swerex_suite_s": round(self.seconds, 1),
        }


def _parse_junit(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                messages[name] = (child.get("message") or "").splitlines()[0][:300] if child.get("message") else ""
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                messages[name] = (child.get("message") or "")[:300]
        outcomes[name] = outcome
    return outcomes, messages


async def run_suite(url: str, token: str, image: str, cache: Path, say: Say = _quiet,
                    timeout: float = 900.0) -> SuiteResult:
    """Run the suite in a pytest subprocess against the DSec at ``url``."""
    root = await asyncio.to_thread(suite_dir, cache, say)
    junit = root / f"junit-{secrets.token_hex(4)}.xml"
    env = {**os.environ, "DSEC_URL": url, "DSEC_TOKEN": token, "DSEC_SWEREX_IMAGE": image,
           "PYTHONDONTWRITEBYTECODE": "1"}
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN", f"--junitxml={junit}",
            "-o", "junit_family=xunit1", f"tests/{SUITE_FILE}"]
    say(f"swerex: SWE-ReX's own tests/{SUITE_FILE} against DSecRuntime ({image})")
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*argv, cwd=root, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"SWE-ReX's suite did not finish in {timeout} s") from None
    result = SuiteResult(seconds=time.monotonic() - t0, returncode=proc.returncode or 0,
                         log=out.decode(errors="replace"))
    try:
        result.outcomes, result.messages = _parse_junit(junit)
    except (OSError, ET.ParseError) as exc:
        raise RuntimeError(f"SWE-ReX's suite left no report ({exc}):\n{result.log[-3000:]}") from None
    finally:
        junit.unlink(missing_ok=True)
    return result


# ---------------------------------------------------------------- latency ----


async def _session_ms(runtime: Any, n: int) -> list[float]:
    from swerex.runtime.abstract import (
        BashAction,
        CloseBashSessionRequest,
        CreateBashSessionRequest,
    )

    await runtime.create_session(CreateBashSessionRequest())
    action = BashAction(command="echo hello", check="raise", timeout=30)
    out: list[float] = []
    try:
        for i in range(n + 5):
            t0 = time.perf_counter()
            obs = await runtime.run_in_session(action)
            ms = (time.perf_counter() - t0) * 1000
            if obs.output != "hello\n":
                raise RuntimeError(f"run_in_session answered {obs.output!r}")
            if i >= 5:
                out.append(ms)
    finally:
        await runtime.close_session(CloseBashSessionRequest())
    return out


async def dsec_session_ms(url: str, token: str, image: str, n: int) -> list[float]:
    from dsec.compat.swerex import DSecDeployment

    d = DSecDeployment(image=image, url=url, token=token, labels={"bench": "swerex"})
    await d.start()
    try:
        return await _session_ms(d.runtime, n)
    finally:
        await d.stop()


@contextlib.contextmanager
def own_server() -> Iterator[tuple[int, str]]:
    """``swerex-remote`` (SWE-ReX's server, bash through pexpect) on 127.0.0.1, no container."""
    port, token = _free_port(), secrets.token_hex(8)
    home = tempfile.TemporaryDirectory(prefix="dsec-swerex-home-")
    # A HOME of its own: its bash reads no rc file of this host's (a container's would not either);
    # and TERM=dumb, as in a container (a terminal's TERM turns on bracketed paste: "\r"s in the output)
    env = {**os.environ, "HOME": home.name, "TERM": "dumb"}
    proc = subprocess.Popen([sys.executable, "-m", "swerex.server", "--host", "127.0.0.1", "--port", str(port),
                             "--auth-token", token], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("swerex-remote did not start")
            time.sleep(0.05)
        yield port, token
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        home.cleanup()


async def own_server_session_ms(n: int) -> list[float]:
    from swerex.runtime.remote import RemoteRuntime

    with own_server() as (port, token):
        runtime = RemoteRuntime(host="http://127.0.0.1", port=port, auth_token=token)
        try:
            return await _session_ms(runtime, n)
        finally:
            with contextlib.suppress(Exception):
                await runtime.close()


# ------------------------------------------------------------------- runs ----


async def measure(url: str, token: str, image: str = IMAGE, *, quick: bool = False, say: Say = _quiet,
                  cache: Path | None = None, suite: bool = True) -> dict[str, Any]:
    """The phase against a DSec that runs (``image`` must be there: :func:`ensure_image`)."""
    n = 50 if quick else 300
    cache = cache or state_dir() / "cache"
    say(f"swerex: run_in_session('echo hello') x{n} through DSecRuntime")
    ours = await dsec_session_ms(url, token, image, n)
    say(f"swerex: the same through SWE-ReX's RemoteRuntime and swerex-remote on this host, x{n}")
    try:
        theirs: list[float] | None = await own_server_session_ms(n)
    except Exception as exc:  # a baseline that cannot run is reported, not fatal
        say(f"swerex: swerex-remote baseline failed: {exc}")
        theirs = None
    results: dict[str, Any] = {
        "swerex_run_in_session_p50_ms": round(percentile(ours, 50), 3),
        "swerex_run_in_session_p90_ms": round(percentile(ours, 90), 3),
        "swerex_own_server_run_in_session_p50_ms": None if theirs is None else round(percentile(theirs, 50), 3),
    }
    if suite:
        res = await run_suite(url, token, image, cache, say)
        results.update(res.summary())
        for name, why in sorted(res.unexpected.items()):
            say(f"swerex: unexpected: {name}: {why}")
        results["swerex_suite_unexpected_names"] = sorted(res.unexpected)
    return results


def ensure_image(layers: Path, cache: Path, say: Say = _quiet) -> str:
    """:data:`IMAGE` in the layer store at ``layers`` (debootstrap once, cached in ``cache``)."""
    from dsec.bench.fncall import python_layer
    from dsec.images.store import LocalLayerStore

    store = LocalLayerStore(layers)
    try:
        name, tag = IMAGE.split(":")
        return python_layer(store, cache, name=name, tag=tag, packages=PACKAGES, say=say)
    finally:
        store.close()


def run(*, quick: bool = False, say: Say = _quiet, suite: bool = True) -> dict[str, Any]:
    """The SWE-ReX phase with its own all-in-one in a temporary data directory."""
    cache = state_dir() / "cache"
    with tempfile.TemporaryDirectory(prefix="dsec-bench-swerex-") as tmp:
        work = Path(tmp)
        image = ensure_image(work / "layers", cache, say)
        with all_in_one(work, say, "swerex") as (url, token, _pid):
            return asyncio.run(measure(url, token, image, quick=quick, say=say, cache=cache, suite=suite))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsec.bench.compat_swerex", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="50 calls instead of 300")
    p.add_argument("--json", dest="json_path", type=Path, help="write the flat JSON here")
    p.add_argument("--no-suite", action="store_true", help="latency only")
    args = p.parse_args(argv)
    results = run(quick=args.quick, say=lambda m: print(m, file=sys.stderr), suite=not args.no_suite)
    text = json.dumps(results, indent=2, sort_keys=True)
    print(text)
    if args.json_path:
        args.json_path.write_text(text)
    return 0 if not results.get("swerex_suite_unexpected") else 1


if __name__ == "__main__":
    sys.exit(main())
