"""Which toolchain runs each SandboxFusion language, and with which commands. Pure data.

Every request runs in a fresh sandbox whose image is the language's toolchain
(``dsec image build --toolchains ...``, dsec/images/toolchains.py): the code is written to
``WORKDIR/<source>``, then ``compile`` (if any, under ``compile_timeout``) and ``run`` (under
``run_timeout``, with the request's stdin) run there, each as one command: :func:`argv`
splits it with ``shlex.split`` and the sandbox runs that argv, with no shell in between (so
a recipe holds no shell syntax: no ``&&``, pipes, redirections or ``$VAR``; request file
names it takes in are quoted with ``shlex.quote``). The commands follow what SandboxFusion's
own runners run, with the Debian toolchains' names; docs/COMPAT.md has the same table for
people.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Final

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


_JAVA_CP = ".:/usr/share/java/javatuples.jar"

RECIPES: Final[dict[str, Recipe]] = {
    "python": Recipe("python", "main.py", "python3 main.py"),
    "pytest": Recipe("pytest", "test_main.py", "python3 -m pytest -p no:cacheprovider test_main.py"),
    "cpp": Recipe("cpp", "main.cpp", "./main", compile="g++ -std=c++17 main.cpp -o main -lcrypto -lssl -lpthread"),
    "c": Recipe("c", "main.c", "./main", compile="gcc main.c -o main -lm -lpthread"),
    "go": Recipe("go", "main.go", "./main", compile="go build -o main main.go",
                 env={"GOCACHE": "/tmp/go-build", "GOPATH": "/tmp/go", "GO111MODULE": "auto"}),
    "go_test": Recipe("go", "main_test.go", "go test -v main_test.go",
                      env={"GOCACHE": "/tmp/go-build", "GOPATH": "/tmp/go", "GO111MODULE": "auto"}),
    "java": Recipe("java", "Main.java", f"java -cp {_JAVA_CP}{{jars}} -ea Main",
                   compile=f"javac -cp {_JAVA_CP}{{jars}} Main.java", jar_classpath=True),
    "nodejs": Recipe("nodejs", "main.js", "node main.js"),
    "typescript": Recipe("typescript", "main.ts", f"node --enable-source-maps {HELPERS}/tsrun.js main.ts", helpers=("tsrun.js",)),
    "rust": Recipe("rust", "main.rs", "./main", compile="rustc main.rs -o main"),
    "bash": Recipe("bash", "main.sh", "bash main.sh"),
}
"""SandboxFusion language -> recipe. The languages of models.Language missing here are
answered ``SandboxError`` naming the ones served."""

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


def commands(recipe: Recipe, files: list[str]) -> tuple[str | None, str]:
    """``(compile, run)`` for a request that brings ``files`` (their names as given)."""
    jars = "".join(":" + shlex.quote(f) for f in files if f.endswith(".jar")) if recipe.jar_classpath else ""
    compile_ = recipe.compile.replace("{jars}", jars) if recipe.compile else None
    return compile_, recipe.run.replace("{jars}", jars)
