"""Which toolchain runs each SandboxFusion language, and with which commands. Pure data.

Every request runs in a fresh sandbox whose image is the language's toolchain
(``dsec image build --toolchains ...``, dsec/images/toolchains.py): the code is written to
``WORKDIR/<source>``, then ``compile`` (if any, under ``compile_timeout``) and ``run`` (under
``run_timeout``, with the request's stdin) run there, each as one command: :func:`argv`
splits it with ``shlex.split`` and the sandbox runs that argv, with no shell in between (so
a recipe holds no shell syntax: no ``&&``, pipes, redirections or ``$VAR``; request file
names it takes in are quoted with ``shlex.quote``). The commands follow what SandboxFusion's
own runners run, with the Debian toolchains' names; docs/COMPAT.md has the same table for
people. A few languages name their source after the code (java's public class for junit,
scala's object) or change it as SandboxFusion does (php's ``<?php`` tag): :func:`plan`.

Languages of SandboxFusion's list that no Debian package supplies (:data:`UNAVAILABLE`) are
answered as SandboxFusion answers when its image lacks a runner's program: the stage that
would call it "finished" with exit code 127 and bash's ``command not found`` (:func:`unavailable`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Final, Literal

WORKDIR: Final = "/workspace"
HELPERS: Final = "/opt/dsec-compat"
"""Where the helper programs a recipe needs (helpers.py) are written, beside the code."""

BASE_ENV: Final[dict[str, str]] = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
}


@dataclass(frozen=True)
class Recipe:
    toolchain: str
    """A name of dsec.images.toolchains.TOOLCHAINS."""
    source: str
    """The file the code is written to, in WORKDIR."""
    run: str
    compile: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    helpers: tuple[str, ...] = ()
    """Helper programs (helpers.py) written under HELPERS for this language."""
    jar_classpath: bool = False
    """Java: request files ending in .jar join the class path, as in SandboxFusion."""
    prepare: Literal["php_tag", "java_public_class", "scala_object", "cs_usings"] | None = None
    """How the source is named or changed from the code (:func:`plan`)."""
    extra_sources: str | None = None
    """Request files with this suffix are compiled too (``{sources}``: junit compiles ``*.java``)."""


_JAVA_CP = ".:/usr/share/java/javatuples.jar"
_JUNIT_JAR = "/usr/share/java/junit-platform-console-standalone.jar"
_GO_ENV = {"GOCACHE": "/tmp/go-build", "GOPATH": "/tmp/go:/usr/share/gocode", "GO111MODULE": "auto",
           "CGO_ENABLED": "0"}
"""GOPATH mode (no go.mod, no module proxy): a second GOPATH entry holds the Debian Go
libraries of the sandboxfusion profile (testify: ``/usr/share/gocode/src/github.com/...``).
No cgo: the go toolchain has no C compiler, and ``net`` (which testify imports) would
otherwise try to build runtime/cgo."""

RECIPES: Final[dict[str, Recipe]] = {
    "python": Recipe("python", "main.py", "python3 main.py"),
    "pytest": Recipe("pytest", "test_main.py", "python3 -m pytest -p no:cacheprovider test_main.py"),
    "cpp": Recipe("cpp", "main.cpp", "./main", compile="g++ -std=c++17 main.cpp -o main -lcrypto -lssl -lpthread"),
    "c": Recipe("c", "main.c", "./main", compile="gcc main.c -o main -lm -lpthread"),
    "go": Recipe("go", "main.go", "./main", compile="go build -o main main.go", env=_GO_ENV),
    "go_test": Recipe("go", "main_test.go", "go test -v main_test.go", env=_GO_ENV),
    "java": Recipe("java", "Main.java", f"java -cp {_JAVA_CP}{{jars}} -ea Main",
                   compile=f"javac -cp {_JAVA_CP}{{jars}} Main.java", jar_classpath=True),
    "nodejs": Recipe("nodejs", "main.js", "node main.js"),
    "typescript": Recipe("typescript", "main.ts", f"node --enable-source-maps {HELPERS}/tsrun.js main.ts", helpers=("tsrun.js",)),
    "rust": Recipe("rust", "main.rs", "./main", compile="rustc main.rs -o main"),
    "bash": Recipe("bash", "main.sh", "bash main.sh"),
    "php": Recipe("php", "main.php", "php -f main.php", prepare="php_tag"),
    # SandboxFusion builds and runs with `dotnet run` in its run stage: so does the helper, with Mono.
    "csharp": Recipe("csharp", "Program.cs", f"sh {HELPERS}/csrun.sh", helpers=("csrun.sh",), prepare="cs_usings"),
    "ruby": Recipe("ruby", "main.rb", "ruby main.rb"),
    "perl": Recipe("perl", "main.pl", "perl main.pl"),
    "lua": Recipe("lua", "main.lua", "lua main.lua"),
    "R": Recipe("r", "main.R", "Rscript main.R"),
    "scala": Recipe("scala", "main.scala", "scala {class}", compile="scalac main.scala", prepare="scala_object"),
    # Debian's kotlinc always passes -noverify, which JDK 17 warns about on stderr: the VM's
    # warnings off (its script's own default heap otherwise).
    "kotlin_script": Recipe("kotlin", "main.kts", "kotlinc -script main.kts",
                            env={"JAVA_OPTS": "-Xmx256M -Xms32M -XX:-PrintWarnings"}),
    "D_ut": Recipe("d", "main.d", "./test", compile="ldmd2 main.d -unittest -of=test"),
    "racket": Recipe("racket", "main.rkt", "racket main.rkt"),
    "jest": Recipe("jest", "main.test.ts", f"jest --ci --config {HELPERS}/jest.config.js", helpers=("jest.config.js",),
                   env={"FORCE_COLOR": "0"}),
    "junit": Recipe("junit", "{class}.java", f"java -jar {_JUNIT_JAR} --class-path .:{_JUNIT_JAR}{{jars}} "
                    "--scan-class-path", compile=f"javac -cp .:{_JUNIT_JAR}{{jars}} {{class}}.java{{sources}}",
                    jar_classpath=True, prepare="java_public_class", extra_sources=".java"),
    "verilog": Recipe("verilog", "main.sv", "vvp -n test.vvp",
                      compile="iverilog -Wall -Winfloop -Wno-timescale -g2012 -s tb -o test.vvp main.sv"),
}
"""SandboxFusion language -> recipe. The languages of models.Language missing here are
answered ``SandboxError`` naming the ones served."""



@dataclass(frozen=True)
class Unavailable:
    """A language of SandboxFusion's list that DSec cannot run: no Debian package supplies it."""

    stage: Literal["compile", "run"]
    """The stage whose program is missing (SandboxFusion's command for it)."""
    program: str
    why: str
    """For people: docs/COMPAT.md and the answer's ``message``."""


UNAVAILABLE: Final[dict[str, Unavailable]] = {
    "julia": Unavailable("run", "julia", "Julia is not packaged in Debian bookworm (removed in 2021)"),
    "swift": Unavailable("compile", "swiftc", "Swift is not packaged in Debian bookworm (its `swift` package is "
                                              "OpenStack's object store)"),
    "lean": Unavailable("run", "lake", "Lean 4 is not packaged in Debian (SandboxFusion installs it with elan from "
                                       "GitHub, which this network does not reach)"),
    "cuda": Unavailable("compile", "nvcc", "CUDA needs a GPU, which DSec's sandboxes do not have (and "
                                           "nvidia-cuda-toolkit is in Debian's non-free)"),
    "python_gpu": Unavailable("compile", "nvcc", "python_gpu needs a GPU and the CUDA toolkit, which DSec's "
                                                 "sandboxes do not have"),
}
"""SandboxFusion answers these, when its image lacks the program, with that stage finished at
exit code 127 and ``/bin/bash: line 1: PROGRAM: command not found`` (its runners call every
command through bash): so does DSec, without making a sandbox (:func:`unavailable`)."""

SANDBOXFUSION_LANGUAGES: Final = (
    "python", "pytest", "cpp", "go", "go_test", "java", "junit", "nodejs", "typescript", "jest", "csharp", "rust",
    "php", "bash", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "kotlin_script", "verilog", "lean",
    "swift", "racket", "cuda", "python_gpu",
)
"""The languages SandboxFusion's own server runs (its CODE_RUNNERS that its request model
accepts): what ``sf_languages_served`` counts against. The other names of models.Language
(python2, sql, gtest, react) it answers SandboxError, as DSec does; ``c`` is DSec's own."""


def served() -> list[str]:
    """The languages of :data:`SANDBOXFUSION_LANGUAGES` DSec runs."""
    return [lang for lang in SANDBOXFUSION_LANGUAGES if lang in RECIPES]


JUPYTER: Final = Recipe("jupyter", "", f"python3 {HELPERS}/jupyter_driver.py", helpers=("jupyter_driver.py",),
                        env={"PYDEVD_DISABLE_FILE_VALIDATION": "1"})  # the kernel's debugger: no warnings
"""``/run_jupyter``: the driver starts an IPython kernel and runs the cells in it."""


SHELL_SYNTAX: Final = frozenset({"&&", "||", "|", ";", "&", ">", ">>", "<", "<<", "2>", "2>&1", "(", ")"})
"""Words that mean something only to a shell: in a recipe they would reach its program as
arguments (tests check that no recipe holds one)."""


def argv(command: str) -> list[str]:
    """The argv a command runs as: ``shlex.split``, no shell."""
    return shlex.split(command)


def shell_syntax(command: str) -> list[str]:
    """The words of ``command`` that only a shell would act on (:data:`SHELL_SYNTAX`, ``$VAR``)."""
    return [w for w in argv(command) if w in SHELL_SYNTAX or w.startswith("$")]


def commands(recipe: Recipe, files: list[str], cls: str = "") -> tuple[str | None, str]:
    """``(compile, run)`` for a request that brings ``files`` (their names as given); ``cls``
    fills ``{class}`` (:func:`plan`)."""
    jars = "".join(":" + shlex.quote(f) for f in files if f.endswith(".jar")) if recipe.jar_classpath else ""
    sources = ""
    if recipe.extra_sources:
        own = recipe.source.replace("{class}", cls)
        sources = "".join(" " + shlex.quote(f) for f in files if f.endswith(recipe.extra_sources) and f != own)

    def fill(cmd: str) -> str:
        return cmd.replace("{jars}", jars).replace("{sources}", sources).replace("{class}", cls)

    return (fill(recipe.compile) if recipe.compile else None), fill(recipe.run)


@dataclass(frozen=True)
class Plan:
    """What one request runs: its source file (name and bytes) and its two commands."""

    source: str
    code: str
    compile: str | None
    run: str


class PlanError(ValueError):
    """The request cannot be planned; SandboxFusion answers it as a compile stage in
    ``Error`` (so ``SandboxError``) with this message as its stderr."""


_JAVA_PUBLIC_CLASS = re.compile(r"\bpublic\s+(abstract\s+|final\s+)?class\s+(\w+)")
_SCALA_OBJECT = re.compile(r"object\s+(\w+)(\s*)|(\s+extends\s+\w+\s*){", re.DOTALL | re.MULTILINE)
CS_USINGS: Final = ("using System; using System.IO; using System.Linq; using System.Collections.Generic; "
                    "using System.Net.Http; using System.Threading; using System.Threading.Tasks;\n#line 1\n")
"""The namespaces .NET's console template imports implicitly (SandboxFusion's `dotnet new
console`), made explicit for Mono; ``#line 1`` keeps the messages' line numbers the code's."""


def plan(recipe: Recipe, code: str, files: list[str]) -> Plan:
    """The source and commands of a request, naming the source as SandboxFusion does: java's
    public class (junit; ``Main`` without one), scala's first ``object`` (none: PlanError
    ``Object name not found.``); php gets ``<?php`` when it lacks one."""
    cls = ""
    if recipe.prepare == "php_tag":
        code = code.lstrip()
        if not code.startswith("<?php"):
            code = "<?php\n" + code
    elif recipe.prepare == "cs_usings":
        code = CS_USINGS + code
    elif recipe.prepare == "java_public_class":
        m = _JAVA_PUBLIC_CLASS.search(code)
        cls = m.group(2) if m else "Main"
    elif recipe.prepare == "scala_object":
        found = _SCALA_OBJECT.findall(code)
        cls = found[0][0] if found else ""
        if not cls:
            raise PlanError("Object name not found.")
    compile_, run = commands(recipe, files, cls)
    return Plan(recipe.source.replace("{class}", cls), code, compile_, run)


def unavailable(language: str) -> tuple[Unavailable, str]:
    """``(entry, stderr)`` for a language of :data:`UNAVAILABLE`: bash's words for a missing program."""
    entry = UNAVAILABLE[language]
    return entry, f"/bin/bash: line 1: {entry.program}: command not found\n"
