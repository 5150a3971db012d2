"""``dsec image`` as a person uses it (issue 11, item 8): the build output in a real terminal,
and ``rm`` of a layer a sandbox has just stopped using, beside a running runtime.

The terminal is tmux (the screen as a person sees it, not a byte stream). The runtime
is real: a toolkit layer mounted as EROFS under the runtime's ``layers/`` and stacked
with overlayfs; ``rm`` runs as another process, as it does from a shell.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.images import build_from_dir
from dsec.images.mounts import IDLE_PIN_GRACE_S
from dsec.images.sysmount import mountinfo

needs_mkfs = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs mkfs.erofs")
RM_CODE = "import sys; from dsec.cli.image import image_group; image_group(prog_name='dsec image')"


def _small_tree(root: Path, text: str = "hello\n") -> Path:
    (root / "opt/tool").mkdir(parents=True)
    (root / "opt/tool/README").write_text(text)
    os.chmod(root, 0o755)
    return root


# -- the build output in a terminal ---------------------------------------------------


@pytest.fixture
def tmux() -> Iterator[str]:
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    name = f"dsec-test-{secrets.token_hex(4)}"
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "80", "-y", "24"], check=True)
    try:
        yield name
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)


def _screen(session: str) -> list[str]:
    out = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True,
                         check=True).stdout
    return [ln.rstrip() for ln in out.splitlines() if ln.strip()]


@needs_mkfs
def test_build_in_a_terminal_ends_with_a_summary_and_the_digest(tmux: str, tmp_path: Path) -> None:
    src = _small_tree(tmp_path / "src")
    state = tmp_path / "state"
    cmd = (f"clear; DSEC_STATE_DIR={state} {sys.executable} -c \"{RM_CODE}\" "
           f"build --from-dir {src} --name term --tag t1 --kind toolkit; echo END-$?")
    subprocess.run(["tmux", "send-keys", "-t", tmux, cmd, "Enter"], check=True)
    deadline = time.monotonic() + 60
    while not any(ln.startswith("END-") for ln in _screen(tmux)):
        assert time.monotonic() < deadline, _screen(tmux)
        time.sleep(0.1)
    screen = _screen(tmux)
    end = next(i for i, ln in enumerate(screen) if ln.startswith("END-"))
    assert screen[end] == "END-0", screen
    # The last two lines before the shell's: the summary, then the digest, whole and alone.
    summary, digest = screen[end - 2], screen[end - 1]
    assert re.fullmatch(r"built term:t1 \(toolkit, [0-9.]+ KiB\) in [0-9.]+ s( \(.*\))?", summary), screen
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), screen
    # Nothing of the progress display is left on the screen to collide with them.
    assert not [ln for ln in screen if "━" in ln or "mkfs" in ln], screen
    from dsec.images import LocalLayerStore

    assert LocalLayerStore(state / "layers").resolve("term:t1").digest == digest


# -- rm right after the last sandbox, and the mount going with the layer -------------------


def _mounted(path: Path) -> bool:
    return any(m.mount_point == str(path) for m in mountinfo())


async def _cli_rm(store_root: Path, ref: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", RM_CODE, "--store", str(store_root), "rm", ref,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode(), time.monotonic() - t0


async def _until(pred, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


@needs_mkfs
@pytest.mark.root
def test_rm_after_the_last_sandbox_and_the_mount_goes(rtx, tmp_path: Path) -> None:
    from dsec.spec import ImageRef, SandboxSpec

    rt = rtx.rt
    layer = build_from_dir(rt.store, _small_tree(tmp_path / "t"), name="rmnow", tag="1", kind="toolkit")
    mp = rt.layers.mounts.mountpoint(layer.digest)
    spec = SandboxSpec(image=ImageRef(base="busybox:test", toolkits=("rmnow:1",)))
    rec = rtx.run(rt.create(spec))
    try:
        assert rtx.ok(rec.id, "cat /opt/tool/README") == "hello\n"
        assert _mounted(mp)
        # In use: refused (after the short wait for a runtime's idle pin), and nothing changes.
        code, out, _ = rtx.run(_cli_rm(rt.store.root, "rmnow:1"))
        assert code == 1 and "in use" in out and "runtime:" in out, out
        assert rt.store.resolve("rmnow:1").digest == layer.digest and _mounted(mp)
        assert rtx.ok(rec.id, "cat /opt/tool/README") == "hello\n"
    finally:
        rtx.destroy(rec.id)

    async def right_after() -> tuple[int, str, float, bool]:
        # The way a shell does it: `dsec rm ID && dsec image rm rmnow:1`.
        code, out, took = await _cli_rm(rt.store.root, "rmnow:1")
        gone = await _until(lambda: not _mounted(mp), timeout=3.0)
        return code, out, took, gone

    code, out, took, gone = rtx.run(right_after())
    assert code == 0 and out.strip() == "removed rmnow:1", out
    assert took < IDLE_PIN_GRACE_S + 2.5, took
    assert gone, f"{mp} is still mounted after its layer was removed"
    assert not mp.exists() and not rt.store.blob_path(layer.digest).exists()
    assert layer.digest not in rt.layers.mounts.mounted()


@needs_mkfs
@pytest.mark.root
def test_an_idle_layer_stays_mounted_until_it_is_removed(rtx, tmp_path: Path) -> None:
    from dsec.spec import ImageRef, SandboxSpec

    rt = rtx.rt
    layer = build_from_dir(rt.store, _small_tree(tmp_path / "t", "idle\n"), name="idle", tag="1",
                           kind="toolkit")
    mp = rt.layers.mounts.mountpoint(layer.digest)
    spec = SandboxSpec(image=ImageRef(base="busybox:test", toolkits=("idle:1",)))
    with_layer = rtx.run(rt.create(spec))
    rtx.destroy(with_layer.id)

    async def idle_then_removed() -> tuple[set[str], bool, bool]:
        await asyncio.sleep(IDLE_PIN_GRACE_S + 1.5)  # the pin's grace, and a removal poll or so
        holders, cached = rt.store.holders(layer.digest), _mounted(mp)
        rt.store.remove("idle:1")  # what `dsec image rm` does, from any process
        return holders, cached, await _until(lambda: not _mounted(mp), timeout=3.0)

    holders, cached, gone = rtx.run(idle_then_removed())
    assert holders == set()  # released: nothing blocks rm any more...
    assert cached  # ...but kept mounted while the layer exists: the next create needs no mount
    assert gone and layer.digest not in rt.layers.mounts.mounted()
