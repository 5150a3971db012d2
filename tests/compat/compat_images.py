"""Shared by the compat tests: a small image with bash (busybox plus the host's bash).

SWE-ReX sessions and mini-swe-agent commands need bash; debootstrapping a Debian base
takes a minute, so the default suite uses busybox's applets with the host's ``/bin/bash``
and the libraries ``ldd`` names beside them (Debian 12 host: libtinfo, libc, ld.so). The
full SWE-ReX suite (slow) runs on a Debian image with python and less.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

BASH_IMAGE = "bashbox:latest"


def build_bash_layer(store: Any, *, name: str = "bashbox", tag: str = "latest") -> str:
    """``name:tag`` in ``store``: busybox's rootfs with the host's bash (built once per store)."""
    from dsec.errors import LayerNotFound
    from dsec.images.build import build_busybox_rootfs, build_from_dir

    ref = f"{name}:{tag}"
    try:
        store.resolve(ref)
        return ref
    except LayerNotFound:
        pass
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("needs bash on the host (copied into the test image)")
    ldd = subprocess.run(["ldd", bash], capture_output=True, text=True, check=True).stdout
    libs = re.findall(r"(/\S+\.so[.\d]*)", ldd)
    with tempfile.TemporaryDirectory(prefix="dsec-bashbox-") as tmp:
        root = build_busybox_rootfs(Path(tmp) / "rootfs")
        for src in ["/bin/bash", *libs]:
            dst = root / src.lstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            if dst.exists() or dst.is_symlink():
                dst.unlink()
            shutil.copy2(Path(src).resolve(), dst)
        env = root / "usr/bin/env"
        if not env.exists():  # SWE-ReX starts /usr/bin/env bash; busybox has /bin/env
            env.parent.mkdir(parents=True, exist_ok=True)
            env.symlink_to("/bin/env")
        build_from_dir(store, root, name=name, tag=tag, kind="base")
    return ref
