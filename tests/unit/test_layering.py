"""The package's layering, held by its imports (read with ``ast``, nothing imported).

``images`` -> ``backends`` -> ``edge`` / ``control`` -> ``sdk`` -> ``cli``: a layer never
imports one above it; a backend folder imports only the shared kit (``backends.base``,
``backends.common``), ``images``, ``errors`` and ``spec``; the edge and the control plane
never reach into a backend folder (``backends.registry`` is the one place that names the
kinds); and no two modules import each other, however indirectly (imports under
``TYPE_CHECKING`` apart: they never run).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
KINDS = ("container", "gvisor", "fncall", "microvm")


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for p in (SRC / "dsec").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(module: str, path: Path) -> Iterator[str]:
    """Every dsec module ``module`` imports when it runs (in-function imports included)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            typing_only.update(id(c) for c in ast.walk(n))
    is_pkg = path.name == "__init__.py"
    for n in ast.walk(tree):
        if id(n) in typing_only:
            continue
        names: list[str] = []
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (n.level - 1)]
                mod = ".".join(base + ([n.module] if n.module else []))
            else:
                mod = n.module or ""
            names = [mod, *(f"{mod}.{a.name}" for a in n.names)]
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                yield name


GRAPH = {m: set(_imports(m, p)) for m, p in MODULES.items()}


def _within(module: str, pkg: str) -> bool:
    return module == pkg or module.startswith(pkg + ".")


def _violations(rule: str) -> list[str]:
    out = []
    for m, targets in GRAPH.items():
        for t in sorted(targets):
            if _breaks(rule, m, t):
                out.append(f"{m} imports {t}")
    return out


def _breaks(rule: str, m: str, t: str) -> bool:
    if rule == "backend folders use only the shared kit":
        for kind in KINDS:
            if _within(m, f"dsec.backends.{kind}"):
                allowed = ("dsec.backends.base", "dsec.backends.common", "dsec.images", "dsec.errors", "dsec.spec",
                           f"dsec.backends.{kind}")
                return t.startswith("dsec.") and not any(_within(t, a) for a in allowed)
        return False
    if rule == "the edge and the control plane never reach into a backend folder":
        return (_within(m, "dsec.edge") or _within(m, "dsec.control")) and any(
            _within(t, f"dsec.backends.{k}") for k in KINDS)
    above = {
        "images sits below everything": ("dsec.images", ("dsec.backends", "dsec.edge", "dsec.control", "dsec.sdk",
                                                          "dsec.cli", "dsec.compat", "dsec.bench")),
        "HTTP sits below the services and the SDK": ("dsec.http", ("dsec.backends", "dsec.edge", "dsec.control",
                                                                    "dsec.sdk", "dsec.cli", "dsec.compat", "dsec.bench")),
        "backends sit below the services": ("dsec.backends", ("dsec.edge", "dsec.control", "dsec.sdk", "dsec.cli",
                                                                "dsec.compat", "dsec.bench")),
        "the services sit below the SDK and the CLI": (("dsec.edge", "dsec.control"), ("dsec.sdk", "dsec.cli")),
        "the SDK never imports the services or the CLI": ("dsec.sdk", ("dsec.control", "dsec.edge", "dsec.cli",
                                                                        "dsec.bench")),
    }
    low, high = above[rule]
    lows = (low,) if isinstance(low, str) else low
    return any(_within(m, x) for x in lows) and any(_within(t, h) for h in high)


RULES = ["backend folders use only the shared kit", "the edge and the control plane never reach into a backend folder",
         "images sits below everything", "HTTP sits below the services and the SDK", "backends sit below the services",
         "the services sit below the SDK and the CLI", "the SDK never imports the services or the CLI"]


@pytest.mark.parametrize("rule", RULES)
def test_layering_rule_holds(rule: str) -> None:
    assert _violations(rule) == [], rule


def _cycles() -> list[list[str]]:
    # Tarjan's strongly connected components; a package and its own submodules are layout.
    graph = {m: {t for t in ts if not (t.startswith(m + ".") or m.startswith(t + "."))} for m, ts in GRAPH.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    assert _cycles() == []


def test_the_checker_sees_a_cycle_and_a_breach() -> None:
    """The test above can fail: a made-up back edge is a cycle, a made-up import a breach."""
    GRAPH["dsec.images"] = GRAPH.get("dsec.images", set()) | {"dsec.backends.base"}
    GRAPH["dsec.backends.base"] = GRAPH["dsec.backends.base"] | {"dsec.images"}
    try:
        assert any({"dsec.images", "dsec.backends.base"} <= set(c) for c in _cycles())
        assert _violations("images sits below everything")
    finally:
        GRAPH["dsec.images"] = set(_imports("dsec.images", MODULES["dsec.images"]))
        GRAPH["dsec.backends.base"] = set(_imports("dsec.backends.base", MODULES["dsec.backends.base"]))
