"""SandboxFusion's HTTP API on a real ``dsec up``, called with the released ``sandbox-fusion``
client (0.3.7) and with raw requests shaped as verl sends them.

The toolchain layers are built once (``build_toolchains``: debootstrap + apt, cached under
``$DSEC_STATE_DIR/cache/toolchain-layers``) and copied into each all-in-one's store. The
default run serves python and bash (about a minute to build the first time, then cached);
the other languages and run_jupyter are ``slow``.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import requests
import sandbox_fusion as sf

from conftest import dsec_up

pytestmark = [pytest.mark.root, pytest.mark.timeout(1200)]

CACHE = Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec")) / "cache" / "toolchain-layers"
DEFAULT = ("python", "bash")
EVERYTHING = ("python", "pytest", "c", "cpp", "go", "java", "nodejs", "typescript", "rust", "bash", "jupyter")


def _toolchains(names: Sequence[str], profile: str | None = None) -> Any:
    """The cache store, holding (building once, if needed) the toolchains ``names`` (and
    ``profile``'s library layers over them)."""
    from dsec.errors import LayerNotFound
    from dsec.images.store import LocalLayerStore
    from dsec.images.toolchains import (
        BASE_NAME,
        TOOLCHAINS,
        build_toolchains,
        parse_toolchains,
        toolkit_name,
    )

    store = LocalLayerStore(CACHE)
    try:
        base = store.resolve(f"{BASE_NAME}:bookworm")
        for n in parse_toolchains(names, profile):
            over = TOOLCHAINS[n].over
            lowers = (base.digest,) if over is None else (
                base.digest, store.resolve(f"{toolkit_name(over)}:bookworm").digest)
            if n != "bash" and store.resolve(f"{toolkit_name(n)}:bookworm").parents[:len(lowers)] != lowers:
                raise LayerNotFound(n)
        return store
    except LayerNotFound:
        pass
    if shutil.which("debootstrap") is None:
        pytest.skip("needs debootstrap (or cached toolchain layers) to build the toolchains")
    build_toolchains(store, names, profile=profile)
    return store


@contextlib.contextmanager
def _all_in_one(names: Sequence[str], *, edge: dict[str, Any] | None = None,
                control: dict[str, Any] | None = None, profile: str | None = None) -> Iterator[dict[str, str]]:
    """``dsec up`` (a subprocess) whose edge holds the toolchains ``names`` (with ``profile``'s
    library layers); yields ``url``, ``token``, ``ep`` (the SandboxFusion endpoint with the
    token in the path) and ``data`` (its data directory)."""
    from dsec.images.store import LocalLayerStore
    from dsec.images.toolchains import copy_toolchains

    cache = _toolchains(names, profile)
    with tempfile.TemporaryDirectory(prefix="dsec-test-sf-") as tmp:
        data = Path(tmp)
        dst = LocalLayerStore(data / "layers")
        copy_toolchains(cache, dst, names, profile=profile)
        dst.close()
        extra: list[str] = []
        for flag, cfg in (("--edge-config", edge), ("--control-config", control)):
            if cfg:
                f = data / f"{flag[2:]}.json"
                f.write_text(json.dumps(cfg))
                extra += [flag, str(f)]
        with dsec_up(data, {**os.environ, "DSEC_STATE_DIR": str(data)}, *extra) as env:
            url, token = env["DSEC_URL"], env["DSEC_TOKEN"]
            yield {"url": url, "token": token, "ep": f"{url}/sandboxfusion/{token}", "data": str(data)}


@pytest.fixture(scope="module")
def up() -> Iterator[dict[str, str]]:
    with _all_in_one(DEFAULT) as live:
        yield live


def run(ep: str, code: str, language: str = "python", **kw: Any) -> sf.RunCodeResponse:
    """One call through the released client (no retries: an error must show)."""
    return sf.run_code(sf.RunCodeRequest(code=code, language=language, **kw), endpoint=ep, max_attempts=1)


def post(ep: str, body: dict[str, Any], path: str = "/run_code") -> requests.Response:
    """A raw request as verl's reward code sends it (fields the released client lacks)."""
    return requests.post(ep + path, json=body, timeout=300)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ------------------------------------------------------------ the default run ----


def test_ping_with_and_without_a_token(up: dict[str, str]) -> None:
    assert requests.get(f"{up['url']}/sandboxfusion/v1/ping", timeout=10).json() == "pong"
    assert requests.get(f"{up['ep']}/v1/ping", timeout=10).json() == "pong"


def test_python_stdin_output_and_the_sandbox(up: dict[str, str]) -> None:
    code = ("import os, socket, sys\n"
            "print(sys.stdin.read().strip()[::-1])\n"
            "print(os.getcwd(), os.geteuid())\n"
            "try:\n    socket.create_connection(('192.0.2.1', 80), timeout=2)\n    print('net')\n"
            "except OSError:\n    print('no net')\n")
    r = run(up["ep"], code, stdin="olleh\n")
    assert r.status == sf.RunStatus.Success and r.message == "", r
    assert r.compile_result is None and r.run_result is not None
    assert r.run_result.status == sf.CommandRunStatus.Finished and r.run_result.return_code == 0
    assert r.run_result.stdout == "hello\n/workspace 0\nno net\n", r.run_result
    assert r.run_result.execution_time is not None and 0 < r.run_result.execution_time < 30
    assert r.executor_pod_name and r.executor_pod_name.startswith("e1-")
    assert sf.summary_run_code_result(r, sf.SummaryMapping()) == "Success"


def test_runtime_error_and_exit_code(up: dict[str, str]) -> None:
    r = run(up["ep"], "print('before')\n1/0\n")
    assert r.status == sf.RunStatus.Failed and r.run_result is not None
    assert r.run_result.return_code == 1 and r.run_result.stdout == "before\n"
    assert "ZeroDivisionError" in (r.run_result.stderr or "")
    assert run(up["ep"], "import sys; sys.exit(7)").run_result.return_code == 7  # type: ignore[union-attr]
    mapping = sf.SummaryMapping(RunFailed="RE")
    assert sf.summary_run_code_result(r, mapping) == "RE"


def test_a_run_past_its_timeout(up: dict[str, str]) -> None:
    t0 = time.monotonic()
    r = run(up["ep"], "import time\nprint('started', flush=True)\ntime.sleep(30)\n", run_timeout=1)
    assert time.monotonic() - t0 < 15
    assert r.status == sf.RunStatus.Failed and r.run_result is not None
    assert r.run_result.status == sf.CommandRunStatus.TimeLimitExceeded and r.run_result.return_code is None
    assert r.run_result.stdout == "started\n"
    assert 0.9 < (r.run_result.execution_time or 0) < 10
    assert sf.summary_run_code_result(r, sf.SummaryMapping(RunTimeout="TLE")) == "TLE"


def test_memory_limit_mb_as_verl_sends_it(up: dict[str, str]) -> None:
    body = {"compile_timeout": 10, "run_timeout": 10, "code": "x = bytearray(300 << 20)\nprint(len(x))",
            "stdin": "", "memory_limit_MB": 64, "language": "python", "files": {}, "fetch_files": []}
    resp = post(up["ep"], body)
    assert resp.status_code == 200
    r = resp.json()
    assert r["status"] == "Failed" and r["run_result"]["return_code"] == -9, r
    assert "memory limit (64 MB" in r["run_result"]["stderr"]
    body["memory_limit_MB"] = 512  # the same allocation fits in more
    r = post(up["ep"], body).json()
    assert r["status"] == "Success" and r["run_result"]["stdout"] == f"{300 << 20}\n", r
    body["memory_limit_MB"] = 1 << 30  # more than the service allows: refused like a bad body
    assert post(up["ep"], body).status_code == 422


def test_files_in_and_fetch_files_out(up: dict[str, str]) -> None:
    blob = bytes(range(256)) * 3
    code = ("import hashlib, os\n"
            "data = open('in/data.bin', 'rb').read()\n"
            "open('out.bin', 'wb').write(data[::-1])\n"
            "os.makedirs('sub', exist_ok=True)\n"
            "open('sub/sum.txt', 'w').write(hashlib.sha256(data).hexdigest())\n"
            "print(open('/etc/extra.conf').read())\n")
    r = run(up["ep"], code, files={"in/data.bin": b64(blob), "/etc/extra.conf": b64(b"abs ok")},
            fetch_files=["out.bin", "sub/sum.txt", "missing.txt", "in"])
    assert r.status == sf.RunStatus.Success, r
    assert r.run_result is not None and r.run_result.stdout == "abs ok\n"
    assert set(r.files) == {"out.bin", "sub/sum.txt"}  # missing files and directories are left out
    assert base64.b64decode(r.files["out.bin"]) == blob[::-1]
    import hashlib

    assert base64.b64decode(r.files["sub/sum.txt"]).decode() == hashlib.sha256(blob).hexdigest()


def test_bash(up: dict[str, str]) -> None:
    r = run(up["ep"], 'read name\necho "hi $name"\nexit 3\n', language="bash", stdin="dsec\n")
    assert r.status == sf.RunStatus.Failed and r.run_result is not None
    assert (r.run_result.stdout, r.run_result.return_code) == ("hi dsec\n", 3)


def test_localhost_resolves_in_a_toolchain_sandbox(up: dict[str, str]) -> None:
    """A program that starts a server and talks to ``localhost``: the toolchain base is a
    debootstrap minbase, which has no /etc/hosts; every sandbox gets its own (issue 27)."""
    code = ("import socket, threading\n"
            "srv = socket.create_server(('localhost', 0))\n"
            "threading.Thread(target=lambda: srv.accept()[0].sendall(b'hi'), daemon=True).start()\n"
            "c = socket.create_connection(('localhost', srv.getsockname()[1]), timeout=5)\n"
            "name = socket.gethostname()\n"
            "print(c.recv(2).decode(), socket.gethostbyname('localhost'), socket.gethostbyname(name),\n"
            "      open('/etc/hostname').read().strip() == name)\n")
    r = run(up["ep"], code)
    assert r.status == sf.RunStatus.Success and r.run_result is not None, r
    assert r.run_result.stdout == "hi 127.0.0.1 127.0.1.1 True\n", r.run_result
    r = run(up["ep"], "getent hosts localhost; getent hosts $(hostname)", language="bash")
    assert r.status == sf.RunStatus.Success and r.run_result is not None, r
    lines = [ln.split() for ln in (r.run_result.stdout or "").splitlines()]
    assert lines[0][1:2] == ["localhost"] and lines[1][0] == "127.0.1.1", r.run_result


def test_what_cannot_run_is_a_sandbox_error_saying_why(up: dict[str, str]) -> None:
    r = post(up["ep"], {"code": "select 1;", "language": "sql"}).json()  # SandboxFusion serves no sql either
    assert r["status"] == "SandboxError" and "not served" in r["message"] and "python" in r["message"]
    r = post(up["ep"], {"code": "<?php echo 1;", "language": "php"}).json()  # served, its layers not here
    assert r["status"] == "SandboxError" and "dsec image build --toolchains php" in r["message"], r
    r = post(up["ep"], {"code": "fn main(){}", "language": "rust"}).json()  # its layers are not on this edge
    assert r["status"] == "SandboxError" and "dsec image build --toolchains rust" in r["message"], r
    assert post(up["ep"], {"code": "x", "language": "cobol"}).status_code == 422
    assert post(up["ep"], {"code": "x", "language": "python", "files": {"a": "%%%"}}).json()["status"] == \
        "SandboxError"


def test_languages_no_debian_package_supplies_answer_as_sandboxfusion_without_their_program(
        up: dict[str, str]) -> None:
    """julia, swift, lean, cuda, python_gpu: the stage that calls the missing program finishes
    with bash's 127, as SandboxFusion's server answers when its image lacks it (issue 27)."""
    for language, stage, program in (("julia", "run_result", "julia"), ("lean", "run_result", "lake"),
                                     ("swift", "compile_result", "swiftc"), ("cuda", "compile_result", "nvcc"),
                                     ("python_gpu", "compile_result", "nvcc")):
        r = post(up["ep"], {"code": "x", "language": language}).json()
        other = "compile_result" if stage == "run_result" else "run_result"
        assert r["status"] == "Failed" and r[other] is None and r["executor_pod_name"] is None, r
        assert (r[stage]["status"], r[stage]["return_code"]) == ("Finished", 127), r
        assert r[stage]["stderr"] == f"/bin/bash: line 1: {program}: command not found\n", r
        assert r["message"].startswith(f"dsec: {language} cannot run here: "), r
    r = run(up["ep"], 'println("x")', language="julia")  # the released client reads it as a failed case
    assert sf.summary_run_code_result(r, sf.SummaryMapping(RunFailed="RE")) == "RE"


def test_scala_without_an_object_is_sandboxfusions_sandbox_error(up: dict[str, str]) -> None:
    """SandboxFusion names scala's class after its first ``object``; with none it answers a
    compile stage in Error, so SandboxError, before anything runs (no layer needed)."""
    r = post(up["ep"], {"code": 'println("no object")', "language": "scala"}).json()
    assert r["status"] == "SandboxError" and r["message"] == "Object name not found.", r
    assert r["compile_result"]["status"] == "Error" and r["run_result"] is None, r


def test_tokens(up: dict[str, str]) -> None:
    body = {"code": "print(2)", "language": "python"}
    assert post(f"{up['url']}/sandboxfusion/dsk_nope", body).status_code == 401
    assert post(f"{up['url']}/sandboxfusion", body).status_code == 401  # no token anywhere
    resp = requests.post(f"{up['url']}/sandboxfusion/run_code", json=body, timeout=60,
                         headers={"Authorization": f"Bearer {up['token']}"})
    assert resp.status_code == 200 and resp.json()["run_result"]["stdout"] == "2\n"


def test_64_in_flight_one_request_per_test_case(up: dict[str, str]) -> None:
    """As verl scores a batch: one request per test case, 64 at once, no retries allowed."""
    code = "n = int(input())\nprint(n * n)\n"
    reqs = [sf.RunCodeRequest(code=code, language="python", stdin=f"{i}\n") for i in range(64)]
    t0 = time.monotonic()
    results = sf.run_concurrent(sf.run_code, kwargs=[{"request": r, "endpoint": up["ep"], "max_attempts": 1}
                                                     for r in reqs], concurrency=64)
    took = time.monotonic() - t0
    assert [r.run_result.stdout for r in results] == [f"{i * i}\n" for i in range(64)]
    assert all(r.status == sf.RunStatus.Success for r in results)
    assert len({r.executor_pod_name for r in results}) == 64  # a sandbox each
    assert took < 120, took


def test_a_full_cluster_queues_then_answers_504_which_the_client_retries() -> None:
    """Room for four sandboxes: a burst waits its turn in the window; past queue_timeout_s the
    answer is 504 with Retry-After, which the released client (and verl) retry."""
    with _all_in_one(("python",), edge={"cpu_capacity": 4.0}, control={"sandboxfusion": {"queue_timeout_s": 1.0}}) as live:
        slow = {"code": "import time\ntime.sleep(3)\nprint('done')", "language": "python", "run_timeout": 20}
        with concurrent.futures.ThreadPoolExecutor(7) as pool:
            answers = list(pool.map(lambda _: post(live["ep"], slow), range(7)))
        codes = sorted(a.status_code for a in answers)
        assert codes.count(200) >= 4 and codes.count(504) >= 2, codes
        for a in answers:
            if a.status_code == 504:
                assert int(a.headers["retry-after"]) >= 1 and "no sandbox free" in a.json()["detail"]
            else:
                assert a.json()["run_result"]["stdout"] == "done\n"
        # The released client retries the 504s (exponential backoff, 5 attempts): every case gets its answer.
        reqs = [sf.RunCodeRequest(code="print(int(input()) + 1)", language="python", stdin=f"{i}\n") for i in range(24)]
        results = sf.run_concurrent(sf.run_code, kwargs=[{"request": r, "endpoint": live["ep"]} for r in reqs],
                                    concurrency=24)
        assert [r.run_result.stdout for r in results] == [f"{i + 1}\n" for i in range(24)]


def test_a_token_free_listener_for_skyrl_charges_the_project_in_its_config() -> None:
    """SkyRL posts to ``http://<host>:8080/run_code`` with no token: the listener (off by
    default, loopback) runs such calls as the configured project, whose quota they spend."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    control = {"sandboxfusion": {"queue_timeout_s": 1.0,
                                 "listener": {"enabled": True, "port": port, "project": "rl"}}}
    with _all_in_one(("python",), control=control) as live:
        sky = f"http://127.0.0.1:{port}"
        admin = {"Authorization": f"Bearer {live['token']}"}
        assert requests.get(f"{sky}/v1/ping", timeout=10).json() == "pong"
        body = {"code": "print(6 * 7)", "language": "python", "run_timeout": 10, "memory_limit_MB": 256}
        r = requests.post(f"{sky}/run_code", json=body, timeout=60).json()  # the project does not exist yet
        assert r["status"] == "SandboxError" and "no project 'rl'" in r["message"], r
        made = requests.post(f"{live['url']}/v1/projects", headers=admin, timeout=30, json={
            "name": "rl", "quota": {"sandboxes": 4, "cpu": 4, "memory": 512 << 20}})
        assert made.status_code == 201, made.text
        r = requests.post(f"{sky}/run_code", json=body, timeout=60).json()
        assert r["status"] == "Success" and r["run_result"]["stdout"] == "42\n", r
        # 1 GiB does not fit rl's 512 MiB (the root has room): charged to rl, so refused, then 504
        big = requests.post(f"{sky}/run_code", json={**body, "memory_limit_MB": 1024}, timeout=60)
        assert big.status_code == 504 and "no sandbox free" in big.json()["detail"], big.text
        tokens = requests.get(f"{live['url']}/v1/tokens", headers=admin, timeout=30).json()
        mine = [t for t in tokens if t["name"] == "sandboxfusion-listener"]
        assert [(t["project"], t["revoked_at"]) for t in mine] == [("rl", None)], tokens
        assert not any(t.get("token") for t in tokens)  # its secret never leaves the process
        # the path-token API is still there, and still needs its token
        assert post(f"{live['url']}/sandboxfusion", {"code": "print(1)", "language": "python"}).status_code == 401
    with _all_in_one(("python",)), pytest.raises(requests.ConnectionError):  # off by default: no listener
        requests.post(f"{sky}/run_code", json=body, timeout=10)


def test_the_cli_keeps_current_toolchains() -> None:
    import subprocess
    import sys

    _toolchains(DEFAULT)
    out = subprocess.run([sys.executable, "-m", "dsec.cli.main", "image", "--store", str(CACHE), "build",
                          "--toolchains", "bash,python"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) == 2 and all(d.startswith("sha256:") for d in out.stdout.split())
    assert "kept tc-base:bookworm" in out.stderr and "kept tc-python:bookworm" in out.stderr, out.stderr
    assert "bash: runs on the base alone" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "dsec.cli.main", "image", "--store", str(CACHE), "build",
                          "--toolchains", "cobol"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown toolchain 'cobol'" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "dsec.cli.main", "image", "--store", str(CACHE), "build",
                          "--busybox", "--name", "x", "--profile", "sandboxfusion"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode != 0 and "only apply to --toolchains" in bad.stderr, bad.stderr


# --------------------------------------------------------------- every language ----


@pytest.fixture(scope="module")
def every() -> Iterator[dict[str, str]]:
    with _all_in_one(EVERYTHING) as live:
        yield live


ADD = {  # reads "a b" on stdin, prints a + b
    "cpp": "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;return 0;}\n",
    "c": "#include <stdio.h>\nint main(){long a,b;if(scanf(\"%ld %ld\",&a,&b)!=2)return 2;printf(\"%ld\\n\",a+b);return 0;}\n",
    "go": "package main\nimport \"fmt\"\nfunc main(){ var a, b int; fmt.Scan(&a, &b); fmt.Println(a + b) }\n",
    "java": ("import java.util.*;\npublic class Main { public static void main(String[] x) {"
             " Scanner s = new Scanner(System.in); System.out.println(s.nextLong() + s.nextLong()); } }\n"),
    "nodejs": "const [a, b] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\nconsole.log(a + b);\n",
    "typescript": ("import * as fs from 'fs';\nconst [a, b]: number[] = fs.readFileSync(0, 'utf8').trim().split(/\\s+/)"
                   ".map(Number);\nconsole.log(a + b);\n"),
    "rust": ("use std::io::Read;\nfn main(){ let mut s = String::new(); std::io::stdin().read_to_string(&mut s).unwrap();"
             " let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect(); println!(\"{}\", v[0] + v[1]); }\n"),
    "python": "a, b = map(int, input().split())\nprint(a + b)\n",
    "bash": "read a b\necho $((a + b))\n",
}
BROKEN = {  # does not compile (or, for the interpreted ones, does not parse)
    "cpp": "int main() { return undefined_name; }\n",
    "c": "int main(void) { return undefined_name; }\n",
    "go": "package main\nfunc main() { undefined_name() }\n",
    "java": "public class Main { public static void main(String[] a) { undefinedName(); } }\n",
    "rust": "fn main() { undefined_name(); }\n",
    "typescript": "const x: number = ;\n",
    "nodejs": "function (\n",
}
CRASH = {  # compiles, then fails at run time
    "cpp": "#include <stdexcept>\nint main(){ throw std::runtime_error(\"boom\"); }\n",
    "c": "#include <stdlib.h>\nint main(void){ abort(); }\n",
    "go": "package main\nfunc main() { panic(\"boom\") }\n",
    "java": "public class Main { public static void main(String[] a) { throw new RuntimeException(\"boom\"); } }\n",
    "rust": "fn main() { panic!(\"boom\"); }\n",
    "typescript": "throw new Error('boom');\n",
    "nodejs": "throw new Error('boom');\n",
}
SPIN = {
    "cpp": "int main(){ volatile long x = 0; for(;;) x++; }\n",
    "c": "int main(void){ volatile long x = 0; for(;;) x++; }\n",
    "go": "package main\nfunc main() { for {} }\n",
    "java": "public class Main { public static void main(String[] a) { while (true) {} } }\n",
    "rust": "fn main() { loop {} }\n",
    "typescript": "while (true) {}\n",
    "nodejs": "while (true) {}\n",
}
COMPILED = ("cpp", "c", "go", "java", "rust")


def _ask(ep: str, language: str, code: str, **kw: Any) -> dict[str, Any]:
    body = {"code": code, "language": language, "compile_timeout": 60, "run_timeout": 30, **kw}
    resp = post(ep, body)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("language", list(ADD))
def test_each_language_reads_stdin_and_answers(every: dict[str, str], language: str) -> None:
    r = _ask(every["ep"], language, ADD[language], stdin="40 2\n")
    assert r["status"] == "Success", r
    assert r["run_result"]["stdout"] == "42\n"
    assert (r["compile_result"] is not None) == (language in COMPILED), r
    if language in COMPILED:
        assert r["compile_result"]["status"] == "Finished" and r["compile_result"]["return_code"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("language", list(BROKEN))
def test_each_language_reports_a_compile_error(every: dict[str, str], language: str) -> None:
    r = _ask(every["ep"], language, BROKEN[language])
    assert r["status"] == "Failed", r
    stage = r["compile_result"] if language in COMPILED else r["run_result"]
    assert stage["status"] == "Finished" and stage["return_code"] != 0 and stage["stderr"], r
    if language in COMPILED:
        assert r["run_result"] is None  # nothing runs after a failed compile
        assert sf.summary_run_code_result(sf.RunCodeResponse(**r), sf.SummaryMapping(CompileFailed="CE")) == "CE"


@pytest.mark.slow
@pytest.mark.parametrize("language", list(CRASH))
def test_each_language_reports_a_runtime_error(every: dict[str, str], language: str) -> None:
    r = _ask(every["ep"], language, CRASH[language])
    assert r["status"] == "Failed", r
    assert r["run_result"]["status"] == "Finished" and r["run_result"]["return_code"] != 0, r
    if language != "c":  # abort() says nothing
        assert "boom" in r["run_result"]["stderr"], r


@pytest.mark.slow
@pytest.mark.parametrize("language", list(SPIN))
def test_each_language_runs_into_its_time_limit(every: dict[str, str], language: str) -> None:
    r = _ask(every["ep"], language, SPIN[language], run_timeout=2)
    assert r["status"] == "Failed", r
    assert r["run_result"]["status"] == "TimeLimitExceeded" and r["run_result"]["return_code"] is None, r


@pytest.mark.slow
def test_a_compile_past_its_time_limit(every: dict[str, str]) -> None:
    # a template instantiated 2^20 times: g++ takes far longer than 0.5 s
    code = ("template<int N> struct F { static const long v = F<N-1>::v + F<N-2>::v; };\n"
            "template<> struct F<1> { static const long v = 1; };\ntemplate<> struct F<0> { static const long v = 0; };\n"
            "#include <cstdio>\nint main(){ printf(\"%ld\\n\", F<90>::v); }\n")
    r = _ask(every["ep"], "cpp", code, compile_timeout=0.05)
    assert r["status"] == "Failed" and r["run_result"] is None, r
    assert r["compile_result"]["status"] == "TimeLimitExceeded", r


@pytest.mark.slow
def test_compiled_code_in_a_memory_limit_and_files(every: dict[str, str]) -> None:
    hog = ("#include <cstdlib>\n#include <cstring>\n#include <cstdio>\nint main(){ for(int i=0;i<64;i++){ char* p=(char*)"
           "malloc(16<<20); memset(p,1,16<<20);} puts(\"survived\"); }\n")
    r = _ask(every["ep"], "cpp", hog, memory_limit_MB=256)
    assert r["status"] == "Failed" and r["run_result"]["return_code"] == -9, r
    code = ("#include <fstream>\n#include <string>\nint main(){ std::ifstream in(\"in.txt\"); std::string s; in >> s;"
            " std::ofstream(\"out.txt\") << s << s; }\n")
    r = _ask(every["ep"], "cpp", code, files={"in.txt": b64(b"ab")}, fetch_files=["out.txt"])
    assert r["status"] == "Success" and base64.b64decode(r["files"]["out.txt"]) == b"abab", r


@pytest.mark.slow
def test_java_takes_jars_from_the_request_and_javatuples(every: dict[str, str]) -> None:
    code = ("import org.javatuples.Pair;\npublic class Main { public static void main(String[] a) {"
            " System.out.println(Pair.with(1, \"x\")); assert a.length > 99 : \"asserts on\"; } }\n")
    r = _ask(every["ep"], "java", code)
    assert r["status"] == "Failed" and r["run_result"]["stdout"] == "[1, x]\n", r
    assert "asserts on" in r["run_result"]["stderr"]  # -ea, as SandboxFusion runs java


@pytest.mark.slow
def test_pytest_and_go_test(every: dict[str, str]) -> None:
    r = run(every["ep"], "def test_ok():\n    assert 1 + 1 == 2\n\ndef test_bad():\n    assert 1 == 2\n",
            language="pytest")
    assert r.status == sf.RunStatus.Failed and r.run_result is not None
    assert "1 failed, 1 passed" in (r.run_result.stdout or ""), r.run_result
    r = run(every["ep"], "def test_ok():\n    assert True\n", language="pytest")
    assert r.status == sf.RunStatus.Success, r
    go = "package main\nimport \"testing\"\nfunc TestAdd(t *testing.T) { if 1+1 != 2 { t.Fatal(\"math\") } }\n"
    r = run(every["ep"], go, language="go_test", run_timeout=60)
    assert r.status == sf.RunStatus.Success and "PASS" in (r.run_result.stdout or ""), r  # type: ignore[union-attr]


def jupyter(ep: str, cells: list[str], **kw: Any) -> sf.RunJupyterResponse:
    return sf.run_jupyter(sf.RunJupyterRequest(cells=cells, **kw), endpoint=ep, max_attempts=1)


@pytest.mark.slow
def test_jupyter_keeps_state_across_cells(every: dict[str, str]) -> None:
    r = jupyter(every["ep"], ["a = 'hello'", "a", "print(a)", "import sys; _ = sys.stderr.write('warn\\n')",
                              "raise ValueError('boom')", "b = a.upper()\nb", "from IPython.display import HTML\n"
                              "display(HTML('<b>x</b>'))"])
    assert r.status == sf.RunStatus.Success, r
    assert len(r.cells) == 7
    assert (r.cells[0].stdout, r.cells[0].display, r.cells[0].error) == ("", [], [])
    assert r.cells[1].display == [{"text/plain": "'hello'"}]
    assert r.cells[2].stdout == "hello\n"
    assert r.cells[3].stderr == "warn\n"
    assert r.cells[4].error[0]["ename"] == "ValueError" and r.cells[4].error[0]["evalue"] == "boom"
    assert r.cells[5].display == [{"text/plain": "'HELLO'"}]  # the state survived the error
    assert r.cells[6].display[0]["text/html"] == "<b>x</b>"
    assert r.driver is not None and r.driver.status == sf.CommandRunStatus.Finished


@pytest.mark.slow
def test_jupyter_time_limits_and_files(every: dict[str, str]) -> None:
    r = jupyter(every["ep"], ["import time", "time.sleep(30)", "print('after')"], cell_timeout=1)
    assert r.status == sf.RunStatus.Failed and len(r.cells) == 3, r
    assert r.cells[1].error[0]["ename"] == "KeyboardInterrupt" and r.cells[2].stdout == "after\n"
    r = jupyter(every["ep"], ["import time", "time.sleep(30)", "print('never')"], total_timeout=2)
    assert r.status == sf.RunStatus.Failed and len(r.cells) == 2, r
    r = jupyter(every["ep"], ["data = open('in.txt').read()", "open('out.txt', 'w').write(data * 2)"],
                files={"in.txt": b64(b"hi")}, fetch_files=["out.txt"])
    assert r.status == sf.RunStatus.Success and base64.b64decode(r.files["out.txt"]) == b"hihi", r


# ------------------------------------- SandboxFusion's other languages (issue 27) ----

MORE = ("php", "csharp", "ruby", "perl", "lua", "r", "scala", "kotlin", "d", "racket", "jest", "junit", "verilog")
"""Toolchains of the languages SandboxFusion serves beyond the first eleven."""


@pytest.fixture(scope="module")
def more() -> Iterator[dict[str, str]]:
    with _all_in_one(MORE) as live:
        yield live


TRIVIAL: dict[str, tuple[str, str]] = {  # language -> (code that reads "40 2" and prints 42, what stdout starts with)
    "php": ("[$a, $b] = array_map('intval', explode(' ', trim(fgets(STDIN))));\necho $a + $b, \"\\n\";\n", "42\n"),
    "csharp": ("class Program { static void Main() {\n  var p = Console.ReadLine().Split(' ').Select(long.Parse)"
               ".ToArray();\n  Console.WriteLine(p[0] + p[1]);\n} }\n", "42\n"),  # System and Linq: implicit in .NET
    "ruby": ("a, b = gets.split.map(&:to_i)\nputs a + b\n", "42\n"),
    "perl": ("my ($a, $b) = split ' ', <STDIN>;\nprint $a + $b, \"\\n\";\n", "42\n"),
    "lua": ("local luaunit = require('luaunit')\nlocal a, b = io.read('*n', '*n')\nprint(a + b)\n", "42\n"),
    "R": ("x <- scan(file('stdin'), quiet = TRUE)\ncat(sum(x), '\\n', sep = '')\n", "42\n"),
    "scala": ("object Adder {\n  def main(args: Array[String]): Unit = {\n    val Array(a, b) = scala.io.StdIn.readLine()"
              ".trim.split(\" \").map(_.toLong)\n    println(a + b)\n  }\n}\n", "42\n"),
    "kotlin_script": ("val (a, b) = readLine()!!.trim().split(\" \").map { it.toLong() }\nprintln(a + b)\n", "42\n"),
    "D_ut": ("import std.stdio, std.conv, std.string, std.array, std.algorithm;\n"
             "void main() { auto p = readln().strip().split().map!(to!long).array; writeln(p[0] + p[1]); }\n", "42\n"),
    "racket": ("#lang racket\n(define a (read))\n(define b (read))\n(displayln (+ a b))\n", "42\n"),
    "verilog": ("module tb;\n  integer a = 40, b = 2;\n  initial begin\n    $display(\"%0d\", a + b);\n    $finish;\n"
                "  end\nendmodule\n", "42\n"),
}
TEST_RUNNERS: dict[str, tuple[str, str, str]] = {  # language -> (passing tests, failing tests, where a pass shows)
    "jest": ("import _ from 'lodash';\nconst add = (a: number, b: number): number => a + b;\n"
             "test('adds', () => { expect(add(40, 2)).toBe(42); expect(_.sum([40, 2])).toBe(42); });\n",
             "test('fails', () => { expect(1 + 1).toBe(3); });\n", "PASS"),
    "junit": ("import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.assertEquals;\n"
              "public class AddTest {\n  @Test void adds() { assertEquals(42, 40 + 2); }\n}\n",
              "import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.assertEquals;\n"
              "public class BadTest {\n  @Test void bad() { assertEquals(3, 1 + 1); }\n}\n", "1 tests successful"),
}
MORE_BROKEN = {  # does not compile (the compiled ones) or does not parse
    "php": "echo 1 +;\n", "csharp": "class Program { static void Main() { undefined_name(); } }\n",
    "ruby": "def x(\n", "perl": "my $x = ;\n", "lua": "local = 1\n", "R": "x <- (\n",
    "scala": "object Main { def main(a: Array[String]): Unit = undefinedName() }\n",
    "kotlin_script": "val x: Int = \"no\"\n", "D_ut": "void main() { undefined_name(); }\n",
    "racket": "#lang racket\n(define (x)\n", "verilog": "module tb; initial begin undefined_task; end endmodule\n",
}
MORE_COMPILED = ("scala", "D_ut", "verilog", "junit")


@pytest.mark.slow
@pytest.mark.parametrize("language", list(TRIVIAL))
def test_more_languages_read_stdin_and_answer(more: dict[str, str], language: str) -> None:
    code, out = TRIVIAL[language]
    r = _ask(more["ep"], language, code, stdin="40 2\n", run_timeout=60)
    assert r["status"] == "Success", r
    assert r["run_result"]["stdout"].startswith(out), r
    assert (r["compile_result"] is not None) == (language in MORE_COMPILED), r
    if language in ("kotlin_script", "php", "ruby", "perl", "lua", "R", "racket"):
        assert r["run_result"]["stderr"] == "", r  # no toolchain noise (kotlinc's JVM warned about -noverify)


@pytest.mark.slow
@pytest.mark.parametrize("language", list(MORE_BROKEN))
def test_more_languages_report_a_compile_or_syntax_error(more: dict[str, str], language: str) -> None:
    r = _ask(more["ep"], language, MORE_BROKEN[language], run_timeout=60)
    assert r["status"] == "Failed", r
    stage = r["compile_result"] if language in MORE_COMPILED else r["run_result"]
    assert stage["status"] == "Finished" and stage["return_code"] != 0 and (stage["stderr"] or stage["stdout"]), r
    if language in MORE_COMPILED:
        assert r["run_result"] is None


@pytest.mark.slow
@pytest.mark.parametrize("language", list(TEST_RUNNERS))
def test_jest_and_junit_run_tests_like_pytest(more: dict[str, str], language: str) -> None:
    good, bad, shows = TEST_RUNNERS[language]
    r = _ask(more["ep"], language, good, run_timeout=90, compile_timeout=60)
    assert r["status"] == "Success", r
    assert shows in r["run_result"]["stdout"] + r["run_result"]["stderr"], r
    r = _ask(more["ep"], language, bad, run_timeout=90, compile_timeout=60)
    assert r["status"] == "Failed" and r["run_result"]["return_code"] == 1, r


@pytest.mark.slow
def test_php_gets_its_tag_and_more_languages_time_out(more: dict[str, str]) -> None:
    r = _ask(more["ep"], "php", "<?php\necho 'tagged', PHP_EOL;\n")
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "tagged\n", r
    r = _ask(more["ep"], "ruby", "loop { }\n", run_timeout=2)
    assert r["status"] == "Failed" and r["run_result"]["status"] == "TimeLimitExceeded", r
    r = _ask(more["ep"], "perl", "die 'boom'\n")
    assert r["status"] == "Failed" and r["run_result"]["return_code"] != 0 and "boom" in r["run_result"]["stderr"]
    # D_ut: built with -unittest; with unittest blocks they run (not main), a failing one fails the run
    d = "unittest { assert(1 + 1 == 2); }\nunittest { assert(1 + 1 == 3, \"math\"); }\nvoid main() {}\n"
    r = _ask(more["ep"], "D_ut", d)
    assert r["status"] == "Failed" and r["compile_result"]["return_code"] == 0, r
    assert r["run_result"]["return_code"] == 1 and "1/1 modules FAILED unittests" in r["run_result"]["stderr"], r
    r = _ask(more["ep"], "D_ut", "import std.stdio;\nunittest { assert(1 + 1 == 2); }\nvoid main() { writeln(1); }\n")
    assert r["status"] == "Success" and r["run_result"]["return_code"] == 0, r


# ------------------------------------------ the sandboxfusion profile (issue 27) ----

PROFILED = ("python", "pytest", "jupyter", "nodejs", "typescript", "go")


@pytest.fixture(scope="module")
def profiled() -> Iterator[dict[str, str]]:
    with _all_in_one(PROFILED, profile="sandboxfusion", control={"sandboxfusion": {"profile": "sandboxfusion"}}) as live:
        yield live


VERL_NUMPY = '''import numpy as np
import sys

def solve(lines):
    n = int(lines[0])
    a = np.array(list(map(int, lines[1].split())), dtype=np.int64)
    return int(np.sort(a)[-n:].sum())

print(solve(sys.stdin.read().split("\\n")))
'''


@pytest.mark.slow
def test_a_verl_reference_solution_importing_numpy_runs_unchanged(profiled: dict[str, str]) -> None:
    """What verl posts for a code dataset's test case (its fields, raw), with a reference
    solution that imports numpy: the profile's library layer is stacked over python."""
    body = {"compile_timeout": 10, "run_timeout": 10, "code": VERL_NUMPY, "stdin": "2\n5 1 9 3\n",
            "memory_limit_MB": 1024, "language": "python", "files": {}, "fetch_files": []}
    r = post(profiled["ep"], body).json()
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "14\n", r
    libs = ("import numpy, pandas, matplotlib, requests, scipy, sympy, sklearn\n"
            "matplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nplt.plot([1, 2]); plt.savefig('p.png')\n"
            "print(pandas.DataFrame({'a': [1, 2]}).a.sum(), sympy.factorint(12), scipy.special.comb(5, 2))\n")
    r = _ask(profiled["ep"], "python", libs, fetch_files=["p.png"], run_timeout=60)
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "3 {2: 2, 3: 1} 10.0\n", r
    assert base64.b64decode(r["files"]["p.png"])[:4] == b"\x89PNG"
    # the same library layer over pytest's and jupyter's toolkits
    r = _ask(profiled["ep"], "pytest", "import numpy as np\n\ndef test_np():\n    assert np.arange(4).sum() == 6\n")
    assert r["status"] == "Success" and "1 passed" in r["run_result"]["stdout"], r
    j = jupyter(profiled["ep"], ["import pandas as pd", "pd.Series([1, 2, 3]).sum()"])
    assert j.status == sf.RunStatus.Success and j.cells[1].display == [{"text/plain": "6"}], j


@pytest.mark.slow
def test_the_cli_builds_a_profiles_library_layers(profiled: dict[str, str]) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "dsec.cli.main", "image", "--store", str(CACHE), "build",
                          "--toolchains", "go", "--profile", "sandboxfusion"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "kept tc-go:bookworm" in out.stderr and "kept tc-sf-go:bookworm" in out.stderr, out.stderr
    assert len(out.stdout.split()) == 3  # base, go, sf-go


@pytest.mark.slow
def test_the_profile_gives_node_lodash_and_go_testify(profiled: dict[str, str]) -> None:
    for language, code in (("nodejs", "const _ = require('lodash');\nconsole.log(_.chunk([1, 2, 3], 2));\n"),
                           ("typescript", "import _ from 'lodash';\nconsole.log(_.chunk([1, 2, 3], 2));\n")):
        r = _ask(profiled["ep"], language, code)
        assert r["status"] == "Success" and r["run_result"]["stdout"] == "[ [ 1, 2 ], [ 3 ] ]\n", r
    go = ('package main\nimport (\n  "testing"\n  "github.com/stretchr/testify/assert"\n)\n'
          'func TestAdd(t *testing.T) { assert.Equal(t, 42, 40+2) }\n')
    r = _ask(profiled["ep"], "go_test", go, run_timeout=120)
    assert r["status"] == "Success" and "PASS" in r["run_result"]["stdout"], r
    r = _ask(profiled["ep"], "go_test", go.replace("40+2", "40+1"), run_timeout=120)
    assert r["status"] == "Failed" and "Not equal" in r["run_result"]["stdout"], r
