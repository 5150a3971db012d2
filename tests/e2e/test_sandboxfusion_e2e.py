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


def _toolchains(names: Sequence[str]) -> Any:
    """The cache store, holding (building once, if needed) the toolchains ``names``."""
    from dsec.errors import LayerNotFound
    from dsec.images.store import LocalLayerStore
    from dsec.images.toolchains import BASE_NAME, build_toolchains, toolkit_name

    store = LocalLayerStore(CACHE)
    try:
        base = store.resolve(f"{BASE_NAME}:bookworm")
        for n in names:
            if n != "bash" and store.resolve(f"{toolkit_name(n)}:bookworm").parents[:1] != (base.digest,):
                raise LayerNotFound(n)
        return store
    except LayerNotFound:
        pass
    if shutil.which("debootstrap") is None:
        pytest.skip("needs debootstrap (or cached toolchain layers) to build the toolchains")
    build_toolchains(store, names)
    return store


@contextlib.contextmanager
def _all_in_one(names: Sequence[str], *, edge: dict[str, Any] | None = None,
                control: dict[str, Any] | None = None) -> Iterator[dict[str, str]]:
    """``dsec up`` (a subprocess) whose edge holds the toolchains ``names``; yields ``url``,
    ``token`` and ``ep`` (the SandboxFusion endpoint with the token in the path)."""
    from dsec.images.store import LocalLayerStore
    from dsec.images.toolchains import copy_toolchains

    cache = _toolchains(names)
    with tempfile.TemporaryDirectory(prefix="dsec-test-sf-") as tmp:
        data = Path(tmp)
        dst = LocalLayerStore(data / "layers")
        copy_toolchains(cache, dst, names)
        dst.close()
        extra: list[str] = []
        for flag, cfg in (("--edge-config", edge), ("--control-config", control)):
            if cfg:
                f = data / f"{flag[2:]}.json"
                f.write_text(json.dumps(cfg))
                extra += [flag, str(f)]
        with dsec_up(data, {**os.environ, "DSEC_STATE_DIR": str(data)}, *extra) as env:
            url, token = env["DSEC_URL"], env["DSEC_TOKEN"]
            yield {"url": url, "token": token, "ep": f"{url}/sandboxfusion/{token}"}


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
    r = post(up["ep"], {"code": "<?php echo 1;", "language": "php"}).json()
    assert r["status"] == "SandboxError" and "not served" in r["message"] and "python" in r["message"]
    r = post(up["ep"], {"code": "fn main(){}", "language": "rust"}).json()  # its layers are not on this edge
    assert r["status"] == "SandboxError" and "dsec image build --toolchains rust" in r["message"], r
    assert post(up["ep"], {"code": "x", "language": "cobol"}).status_code == 422
    assert post(up["ep"], {"code": "x", "language": "python", "files": {"a": "%%%"}}).json()["status"] == \
        "SandboxError"


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
