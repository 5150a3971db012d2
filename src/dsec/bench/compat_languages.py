"""``dsec bench compat --phase sf_languages``: SandboxFusion's languages on DSec, each beside
the same toolchain run locally.

Figures, not assertions:

- ``sf_languages_served`` of ``sf_languages_of``: the languages of SandboxFusion's own list
  (languages.SANDBOXFUSION_LANGUAGES) DSec runs; ``sf_languages_unavailable``: the others
  (answered as SandboxFusion answers a missing runner);
- ``sf_lang_<language>_p50_ms``: a trivial program (:data:`PROGRAMS`: prints ``hello``, or
  one passing test for the test runners) through ``run_code`` — a fresh sandbox of the
  language's toolchain, compile stage if any, run stage, answer —, ``n`` calls one after
  another after one unmeasured call;
- ``sf_lang_<language>_local_p50_ms``: the same source and the same commands as plain
  subprocesses on this host (what SandboxFusion's server does per call), alternating with
  DSec's calls; None where this host lacks the toolchain's programs
  (``sf_lang_local_missing`` names those languages);
- ``sf_layer_<toolchain>_mib``: the size of each toolkit layer (``tc-base`` included, the
  sandboxfusion profile's library layers too), lz4hc EROFS as stored.

The toolchains are built once into the cache store (``$DSEC_STATE_DIR/cache/toolchain-layers``,
kept current, never rebuilt here) and copied into the all-in-one's own store.

Must never: leave a sandbox behind (the all-in-one stops with Ctrl-C).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import requests

from dsec.bench.compat_kit import Say, _alternating, all_in_one, toolchain_cache
from dsec.bench.stats import percentile
from dsec.compat.sandboxfusion import languages
from dsec.compat.sandboxfusion.helpers import helper

MiB = 1 << 20
PROFILE = "sandboxfusion"
PROGRAMS: dict[str, str] = {
    "python": "print('hello')\n",
    "pytest": "def test_ok():\n    assert 1 + 1 == 2\n",
    "cpp": "#include <cstdio>\nint main() { std::puts(\"hello\"); return 0; }\n",
    "go": "package main\nimport \"fmt\"\nfunc main() { fmt.Println(\"hello\") }\n",
    "go_test": "package main\nimport \"testing\"\nfunc TestOk(t *testing.T) { if 1+1 != 2 { t.Fatal(\"math\") } }\n",
    "java": "public class Main { public static void main(String[] a) { System.out.println(\"hello\"); } }\n",
    "junit": ("import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.assertEquals;\n"
              "public class OkTest { @Test void ok() { assertEquals(2, 1 + 1); } }\n"),
    "nodejs": "console.log('hello');\n",
    "typescript": "const s: string = 'hello';\nconsole.log(s);\n",
    "jest": "test('ok', () => { const n: number = 1 + 1; expect(n).toBe(2); });\n",
    "csharp": "class Program { static void Main() { Console.WriteLine(\"hello\"); } }\n",
    "rust": "fn main() { println!(\"hello\"); }\n",
    "php": "echo \"hello\\n\";\n",
    "bash": "echo hello\n",
    "lua": "print('hello')\n",
    "R": "cat('hello\\n')\n",
    "perl": "print \"hello\\n\";\n",
    "D_ut": "import std.stdio;\nvoid main() { writeln(\"hello\"); }\n",
    "ruby": "puts 'hello'\n",
    "scala": "object Main { def main(a: Array[String]): Unit = println(\"hello\") }\n",
    "kotlin_script": "println(\"hello\")\n",
    "verilog": "module tb; initial begin $display(\"hello\"); $finish; end endmodule\n",
    "racket": "#lang racket\n(displayln \"hello\")\n",
}
TEST_RUNNERS = frozenset({"pytest", "go_test", "junit", "jest"})
"""Languages whose program is a passing test: Success is the check, not ``hello``."""
TIMEOUT_S = 120.0


def _check(language: str, answer: dict[str, Any]) -> None:
    run = answer.get("run_result") or {}
    if answer.get("status") != "Success" or (language not in TEST_RUNNERS
                                             and not (run.get("stdout") or "").startswith("hello")):
        raise RuntimeError(f"{language}: unexpected answer {str(answer)[:600]}")


def _sf_ms(ep: str, language: str) -> float:
    body: dict[str, Any] = {"code": PROGRAMS[language], "language": language, "compile_timeout": TIMEOUT_S,
            "run_timeout": TIMEOUT_S}
    t0 = time.perf_counter()
    resp = requests.post(f"{ep}/run_code", json=body, timeout=2 * TIMEOUT_S + 60)
    ms = (time.perf_counter() - t0) * 1000
    resp.raise_for_status()
    _check(language, resp.json())
    return ms


def _local_argv(cmd: str, helpers_dir: Path) -> list[str]:
    return languages.argv(cmd.replace(languages.HELPERS, str(helpers_dir)))


def local_programs(language: str) -> list[str]:
    """The programs the language's commands call that this host lacks (empty: it can run them)."""
    recipe = languages.RECIPES[language]
    p = languages.plan(recipe, PROGRAMS[language], [])
    missing = []
    for cmd in (p.compile, p.run):
        if cmd is None:
            continue
        prog = languages.argv(cmd)[0]
        if not prog.startswith("./") and shutil.which(prog) is None:
            missing.append(prog)
    return missing


def _local_ms(language: str) -> float:
    """The language's source and commands as subprocesses in a fresh directory on this host."""
    recipe = languages.RECIPES[language]
    p = languages.plan(recipe, PROGRAMS[language], [])
    env = {**languages.BASE_ENV, **recipe.env}
    with tempfile.TemporaryDirectory(prefix="dsec-bench-lang-") as tmp:
        work, helpers_dir = Path(tmp, "w"), Path(tmp, "h")
        work.mkdir()
        helpers_dir.mkdir()
        t0 = time.perf_counter()
        for h in recipe.helpers:
            (helpers_dir / h).write_bytes(helper(h))
        (work / p.source).write_text(p.code)
        out = b""
        for cmd in (p.compile, p.run):
            if cmd is None:
                continue
            r = subprocess.run(_local_argv(cmd, helpers_dir), cwd=work, env=env, capture_output=True,
                               timeout=TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"{language} here: {cmd}: exit {r.returncode}: {r.stderr.decode()[-300:]}")
            out = r.stdout
        ms = (time.perf_counter() - t0) * 1000
    if language not in TEST_RUNNERS and not out.startswith(b"hello"):
        raise RuntimeError(f"{language} here printed {out[:200]!r}")
    return ms


def layer_sizes(store: Any, suite: str = "bookworm") -> dict[str, float]:
    """``sf_layer_<toolchain>_mib`` of every toolkit layer the store holds (and ``base``)."""
    from dsec.errors import LayerNotFound
    from dsec.images.toolchains import BASE_NAME, TOOLCHAINS, toolkit_name

    out: dict[str, float] = {}
    for name, ref in [("base", f"{BASE_NAME}:{suite}"),
                      *((n, f"{toolkit_name(n)}:{suite}") for n, tc in TOOLCHAINS.items() if tc.packages)]:
        try:
            out[f"sf_layer_{name}_mib"] = round(store.resolve(ref).size / MiB, 1)
        except LayerNotFound:
            continue
    return out


def run(quick: bool, say: Say) -> dict[str, Any]:
    from dsec.images.store import LocalLayerStore
    from dsec.images.toolchains import build_toolchains, copy_toolchains

    served = languages.served()
    n = 3 if quick else 10
    res: dict[str, Any] = {
        "sf_languages_served": len(served), "sf_languages_of": len(languages.SANDBOXFUSION_LANGUAGES),
        "sf_languages_unavailable": ",".join(languages.UNAVAILABLE), "sf_lang_calls": n,
    }
    toolchains = sorted({languages.RECIPES[lang].toolchain for lang in served})
    cache = LocalLayerStore(toolchain_cache())
    try:
        built = build_toolchains(cache, toolchains, profile=PROFILE, progress=None)
        if any(b.built for b in built):
            say(f"sf_languages: built {', '.join(b.toolchain for b in built if b.built)} into {toolchain_cache()}")
        res.update(layer_sizes(cache))
        with tempfile.TemporaryDirectory(prefix="dsec-bench-lang-") as tmp:
            work = Path(tmp)
            store = LocalLayerStore(work / "layers")
            try:
                copy_toolchains(cache, store, toolchains)
            finally:
                store.close()
            missing_here: list[str] = []
            with all_in_one(work, say, "sf_languages") as (url, token, _pid):
                ep = f"{url}/sandboxfusion/{token}"
                for lang in served:
                    absent = ", ".join(local_programs(lang))
                    if absent:
                        absent += " not on this host"
                    else:
                        try:
                            _local_ms(lang)  # unmeasured: can this host run it (e.g. pytest importable)?
                        except Exception as exc:
                            absent = str(exc)[:200]
                    say(f"sf_languages: {lang} x{n}" + (f" (no local run: {absent})" if absent
                                                        else ", each beside a local run"))
                    try:
                        if absent:
                            missing_here.append(lang)
                            (ours,) = _alternating(n, partial(_sf_ms, ep, lang), warm=1)
                            res[f"sf_lang_{lang}_local_p50_ms"] = None
                        else:
                            ours, local = _alternating(n, partial(_sf_ms, ep, lang), partial(_local_ms, lang), warm=1)
                            res[f"sf_lang_{lang}_local_p50_ms"] = round(percentile(local, 50), 1)
                        res[f"sf_lang_{lang}_p50_ms"] = round(percentile(ours, 50), 1)
                    except Exception as exc:  # one language's failure is a figure too
                        say(f"sf_languages: {lang}: {exc}")
                        res[f"sf_lang_{lang}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            res["sf_lang_local_missing"] = ",".join(missing_here)
    finally:
        cache.close()
    res["sf_lang_load1"] = round(os.getloadavg()[0], 2)
    return res
