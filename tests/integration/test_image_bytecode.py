"""Python bytecode in built layers is used by fresh sandboxes, not recompiled (issue 11, item 2).

The layer is this host's own Debian python3 (the interpreter, the libraries it
links, and the stdlib modules and Debian-compiled ``__pycache__`` files that
``import json`` loads) as a toolkit over the busybox base: a real EROFS layer,
a real overlay, a real sandbox. The same tree is built from a directory, a tar
and a ``docker save`` archive (one digest), and once with plain ``mkfs.erofs``
as the control that shows what the test would catch.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from dsec.images import build_from_dir, build_from_oci, build_from_tar
from dsec.images.erofs import make_erofs

pytestmark = [pytest.mark.root]

HOST_PYTHON = Path("/usr/bin/python3")
SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}
LOADED = (
    "import json, sys\n"
    "for m in list(sys.modules.values()):\n"
    "    for f in (getattr(m, '__file__', None), getattr(m, '__cached__', None)):\n"
    "        if f: print(f)\n"
)


def _copy(path: str, root: Path) -> None:
    """``path`` into ``root`` at the same place, content and mtime of what it points to."""
    dest = root / path.lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, dest)


def _libs(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
    return [w for line in out.splitlines() for w in line.split() if w.startswith("/")]


def _python_tree(root: Path) -> str:
    """This host's python3 with what ``import json`` needs; the interpreter's path in it."""
    exe = os.path.realpath(HOST_PYTHON)
    if not exe.startswith("/usr/bin/python3.") or not Path(f"/usr/lib/{Path(exe).name}/os.py").is_file():
        pytest.skip(f"needs the distribution's python3 at {HOST_PYTHON} (found {exe})")
    files = subprocess.run([exe, "-c", LOADED], capture_output=True, text=True, check=True,
                           env=SANDBOX_ENV).stdout.split()
    pycs = [f for f in files if f.endswith(".pyc") and os.path.isfile(f)]
    if not pycs:
        pytest.skip(f"{exe} has no compiled stdlib bytecode to test with")
    libs = {lib for so in files if so.endswith(".so") for lib in _libs(so)}
    for f in {exe, *files, *_libs(exe), *libs}:
        if os.path.isfile(f):
            _copy(f, root)
    os.symlink(Path(exe).name, root / "usr/bin/python3")
    return exe


def _docker_save(tree_tar: bytes, path: Path) -> None:
    files = {
        "l1/layer.tar": tree_tar,
        "cfg.json": b'{"os": "linux"}',
        "manifest.json": json.dumps([{"Config": "cfg.json", "RepoTags": ["py:1"], "Layers": ["l1/layer.tar"]}]).encode(),
    }
    with tarfile.open(path, "w") as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))


def _python_v(rtx, toolkit: str) -> tuple[str, str]:
    """``python3 -v -c 'import json'`` in a fresh sandbox: (its stderr, the json pyc's mtime after)."""
    from dsec.spec import ImageRef, SandboxSpec

    rec = rtx.run(rtx.rt.create(SandboxSpec(image=ImageRef(base="busybox:test", toolkits=(toolkit,)))))
    try:
        r = rtx.sh(rec.id, ["python3", "-v", "-c", "import json; print(json.dumps([1]))"])
        assert r.exit_code == 0 and r.stdout == b"[1]\n", r
        pyc_mtime = rtx.ok(rec.id, "stat -c %Y /usr/lib/python3.*/json/__pycache__/__init__.*.pyc").strip()
        return r.stderr.decode(), pyc_mtime
    finally:
        rtx.destroy(rec.id)


def test_fresh_sandbox_uses_the_layers_bytecode(rtx, tmp_path: Path) -> None:
    tree = tmp_path / "dsec-test-pytree"
    exe = _python_tree(tree)
    lib = f"/usr/lib/{Path(exe).name}"
    source_pyc = tree / lib.lstrip("/") / "json/__pycache__" / os.listdir(tree / lib.lstrip("/") / "json/__pycache__")[0]
    before = source_pyc.read_bytes()
    assert before[8:12] != b"\0\0\0\0"  # Debian's pyc records the real source mtime

    store = rtx.rt.store
    layer = build_from_dir(store, tree, name="pyjson", tag="dir", kind="toolkit")
    assert source_pyc.read_bytes() == before  # the source directory is never modified
    # Every builder gives the same layer: tar and docker save keep the sources' mtimes.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(tree, arcname=".")
    (tmp_path / "tree.tar").write_bytes(buf.getvalue())
    assert build_from_tar(store, tmp_path / "tree.tar", name="pyjson", tag="tar", kind="toolkit").digest == layer.digest
    _docker_save(buf.getvalue(), tmp_path / "save.tar")
    assert build_from_oci(store, tmp_path / "save.tar", name="pyjson", tag="oci", kind="toolkit").digest == layer.digest
    # The control: the same tree through mkfs.erofs alone.
    make_erofs(tree, tmp_path / "raw.erofs")
    raw = store.add_erofs(tmp_path / "raw.erofs", name="pyjson", tag="raw", kind="toolkit")
    assert raw.digest != layer.digest
    try:
        stale, _ = _python_v(rtx, "pyjson:raw")
        assert "bytecode is stale for 'json'" in stale, stale[-3000:]

        out, pyc_mtime = _python_v(rtx, "pyjson:dir")
        assert "bytecode is stale" not in out, [ln for ln in out.splitlines() if "stale" in ln]
        for mod in ("json/__init__", "json/decoder", "encodings/__init__", "re/__init__"):
            src = f"{lib}/{mod}.py"
            assert any(ln.startswith("# ") and ln.endswith(f" matches {src}") for ln in out.splitlines()), (mod, out[-3000:])
        assert pyc_mtime == "0"  # used as it is in the layer, not rewritten into the upper
    finally:
        for tag in ("dir", "tar", "oci", "raw"):
            rtx.rt.layers.maybe_release(layer.digest if tag != "raw" else raw.digest)
            store.remove(f"pyjson:{tag}")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap")
def test_debootstrap_python_bytecode_is_used(rtx) -> None:
    """Debian's own py3compile output, through the debootstrap builder, in a fresh sandbox."""
    from dsec.images import build_debootstrap
    from dsec.spec import ImageRef, SandboxSpec

    layer = build_debootstrap(rtx.rt.store, suite="bookworm", packages=["python3"],
                              name="deb-py", tag="bookworm")
    try:
        rec = rtx.run(rtx.rt.create(SandboxSpec(image=ImageRef(base="deb-py:bookworm"))))
        try:
            r = rtx.sh(rec.id, ["python3", "-v", "-c", "import json"])
            assert r.exit_code == 0, r
            err = r.stderr.decode()
            assert "bytecode is stale" not in err, [ln for ln in err.splitlines() if "stale" in ln]
            assert any(ln.endswith("matches /usr/lib/python3.11/json/__init__.py") for ln in err.splitlines())
        finally:
            rtx.destroy(rec.id)
    finally:
        rtx.rt.layers.maybe_release(layer.digest)
        rtx.rt.store.remove(layer.digest)
