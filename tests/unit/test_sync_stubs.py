"""The sync SDK's type stub (``src/dsec/sdk/sync.pyi``): generated from the async SDK by
scripts/gen_sync_stubs.py, committed, and checked here: it must be what the script writes now
(a changed async method without a regenerated stub fails), declare every method the runtime
sync classes have, and let a type checker see ``dsec.Client``'s methods and their types."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUB = ROOT / "src" / "dsec" / "sdk" / "sync.pyi"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_sync_stubs", ROOT / "scripts" / "gen_sync_stubs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_stub_is_what_the_generator_writes() -> None:
    assert STUB.read_text() == _generator().render(), (
        "src/dsec/sdk/sync.pyi drifted from the async SDK: run .venv/bin/python scripts/gen_sync_stubs.py")


def test_the_stub_declares_every_method_of_the_sync_classes() -> None:
    from dsec.sdk import sync

    tree = ast.parse(STUB.read_text())
    declared = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for sync_name, _ in _generator().PAIRS:
        cls = getattr(sync, sync_name)
        stub = declared[sync_name]
        methods = {f.name: f for f in stub.body if isinstance(f, ast.FunctionDef)}
        for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction):
            if name.startswith("_") and name not in ("__enter__", "__exit__"):
                continue
            assert name in methods, f"{sync_name}.{name} is missing from the stub"
            args = methods[name].args
            stub_params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
            real = [p.name for p in inspect.signature(fn).parameters.values()
                    if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            if real:  # (a method that forwards *args, **kwargs is declared with its twin's)
                assert stub_params == real, f"{sync_name}.{name}: stub {stub_params} != runtime {real}"


def test_a_type_checker_sees_the_sync_client(tmp_path: Path) -> None:
    api = pytest.importorskip("mypy.api")
    user = tmp_path / "user.py"
    user.write_text(textwrap.dedent('''
        import dsec

        def main() -> None:
            spec = dsec.SandboxSpec(image=dsec.ImageRef(base="busybox:latest"))
            with dsec.Client("http://127.0.0.1:7070", "token") as client:
                sb = client.create(spec, labels={"a": "b"})
                reveal_type(sb)
                reveal_type(sb.exec("echo hi", timeout=10))
                reveal_type(sb.files.read("/x"))
                for chunk in sb.exec_stream("ls"):
                    reveal_type(chunk)
                with sb.session() as s:
                    reveal_type(s.run("pwd"))
                reveal_type(sb.fork(2))
                client.create(spec, no_such_argument=1)
    '''))
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n")  # this project's settings (files = src/dsec) must not apply
    out, err, _status = api.run(["--strict", "--no-incremental", "--config-file", str(config),
                                 "--cache-dir", str(tmp_path / "cache"), str(user)])
    revealed = [ln.split("Revealed type is ", 1)[1] for ln in out.splitlines() if "Revealed type is" in ln]
    assert revealed == ['"dsec.sdk.sync.Sandbox"', '"dsec.spec.results.ExecResult"', '"bytes"',
                        '"dsec.sdk.outcomes.OutputChunk | dsec.spec.results.ExecResult"', '"dsec.spec.results.ExecResult"',
                        '"list[dsec.sdk.sync.Sandbox]"'], out + err
    assert 'Unexpected keyword argument "no_such_argument" for "create" of "Client"' in out, out
