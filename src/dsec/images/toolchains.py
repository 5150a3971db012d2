"""Language toolchains as toolkit layers: Debian packages installed over one Debian base.

``dsec image build --toolchains python,cpp,go`` (or :func:`build_toolchains`) makes

- ``tc-base:<suite>``: a debootstrap ``minbase`` of the suite (bash, coreutils, apt), and
- ``tc-<name>:<suite>`` for each toolchain: a **toolkit** layer holding only what
  ``apt-get install --no-install-recommends <packages>`` adds to or changes in that base
  (chroot_apt.py), with the base as its parent.

A sandbox runs a toolchain as ``ImageRef(base="tc-base:<suite>", toolkits=("tc-<name>:<suite>",))``
(:func:`image_for`): the base is one shared lower for every language, each toolkit a small
layer over it. A toolkit is rebuilt when the base it was built on is no longer
``tc-base:<suite>`` (or with ``rebuild``); otherwise an existing one is kept, so the
command is cheap to run again. The table below is the whole recipe; docs/COMPAT.md lists it
with the commands each language runs.

Needs root (debootstrap, a mount namespace, chroot) and the Debian mirror apt uses.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dsec.errors import HostError, InvalidSpec, LayerNotFound

if TYPE_CHECKING:  # the table and the names are pure data: the control plane reads them
    from .build import Progress
    from .layer import Layer
    from .store import LayerStore

log = logging.getLogger("dsec.images")

BASE_NAME = "tc-base"
DEFAULT_SUITE = "bookworm"
INSTALL_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Toolchain:
    name: str
    packages: tuple[str, ...]
    """Installed with ``--no-install-recommends`` over the base; empty: the base alone serves."""
    provides: str
    """What a sandbox gets, for people (``dsec image build --help``, docs)."""
    over: str | None = None
    """A library layer: built over ``tc-base`` + this toolchain's toolkit (stacked, so the
    layer holds the libraries alone) and put above a language's toolkit by a profile."""


TOOLCHAINS: dict[str, Toolchain] = {t.name: t for t in (
    Toolchain("python", ("python3",), "python3 (3.11 on bookworm)"),
    Toolchain("pytest", ("python3", "python3-pytest"), "python3 with pytest"),
    Toolchain("c", ("gcc", "libc6-dev"), "gcc"),
    Toolchain("cpp", ("g++", "libssl-dev"), "g++ (C++17), OpenSSL headers and libraries"),
    Toolchain("go", ("golang-go",), "go (1.19 on bookworm)"),
    Toolchain("java", ("default-jdk-headless", "libjavatuples-java"), "OpenJDK (17 on bookworm) with javatuples"),
    Toolchain("nodejs", ("nodejs",), "node (18 on bookworm)"),
    Toolchain("typescript", ("nodejs", "node-typescript"), "node with the TypeScript compiler module"),
    Toolchain("rust", ("rustc",), "rustc (1.63 on bookworm)"),
    Toolchain("bash", (), "bash and coreutils (the base itself)"),
    Toolchain("jupyter", ("python3-ipykernel", "python3-jupyter-client"), "an IPython kernel and jupyter_client"),
    # SandboxFusion's other languages that Debian bookworm packages (docs/COMPAT.md lists those it does not).
    Toolchain("php", ("php-cli",), "php (8.2 on bookworm)"),
    Toolchain("csharp", ("mono-mcs", "mono-runtime", "libmono-system-core4.0-cil", "libmono-system-numerics4.0-cil"),
              "Mono's C# compiler mcs and runtime (6.8 on bookworm; SandboxFusion has .NET 8)"),
    Toolchain("ruby", ("ruby",), "ruby (3.1 on bookworm)"),
    Toolchain("perl", ("perl",), "perl (5.36 on bookworm) with its full standard library"),
    Toolchain("lua", ("lua5.2", "lua-unit"), "lua 5.2 with luaunit, as SandboxFusion's image"),
    Toolchain("r", ("r-base-core",), "R (4.2 on bookworm): Rscript"),
    Toolchain("scala", ("scala",), "scala (2.11 on bookworm) on OpenJDK 17"),
    Toolchain("kotlin", ("kotlin",), "kotlin (1.3 on bookworm; SandboxFusion has 2.0) on OpenJDK 17"),
    Toolchain("d", ("ldc", "gcc", "libc6-dev"), "LDC (1.30 on bookworm) with its dmd-compatible driver ldmd2 (gcc links)"),
    Toolchain("racket", ("racket",), "racket (8.7 on bookworm)"),
    Toolchain("jest", ("jest", "node-babel7", "node-lodash"),
              "jest (29.3 on bookworm) with babel's env and typescript presets, and lodash"),
    Toolchain("junit", ("default-jdk-headless", "junit5"), "OpenJDK 17 with JUnit 5's console launcher"),
    Toolchain("verilog", ("iverilog",), "Icarus Verilog (11 on bookworm): iverilog and vvp"),
    # Library layers: SandboxFusion's image's packages (``--profile sandboxfusion``), from Debian.
    Toolchain("sf-python", ("python3-numpy", "python3-pandas", "python3-matplotlib", "python3-requests",
                            "python3-scipy", "python3-sympy", "python3-sklearn"),
              "numpy, pandas, matplotlib, requests, scipy, sympy, scikit-learn", over="python"),
    Toolchain("sf-node", ("node-lodash",), "lodash", over="nodejs"),
    Toolchain("sf-go", ("golang-github-stretchr-testify-dev",), "testify (in GOPATH /usr/share/gocode)", over="go"),
)}
PROFILES: dict[str, dict[str, tuple[str, ...]]] = {
    "sandboxfusion": {
        "python": ("sf-python",), "pytest": ("sf-python",), "jupyter": ("sf-python",),
        "nodejs": ("sf-node",), "typescript": ("sf-node",), "go": ("sf-go",),
    },
}
"""Profile -> toolchain -> library layers stacked above its toolkit. ``sandboxfusion``: the
packages of SandboxFusion's image that its reward snippets import (docs/COMPAT.md). A library
layer built over one toolkit serves others of the same interpreter (sf-python over pytest and
jupyter, sf-node over typescript): its files are the libraries and their dependencies."""
_TOOLCHAIN_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")


def toolkit_name(toolchain: str) -> str:
    return f"tc-{toolchain}"


def image_for(toolchain: str, suite: str = DEFAULT_SUITE,
              profile: str | None = None) -> tuple[str, tuple[str, ...]]:
    """``(base ref, toolkit refs)`` of a sandbox that runs ``toolchain``: its toolkit, then
    (topmost) the library layers ``profile`` puts over it."""
    tc = TOOLCHAINS[toolchain]
    names = ((tc.name,) if tc.packages else ()) + (profile_layers(profile).get(toolchain, ()) if profile else ())
    return f"{BASE_NAME}:{suite}", tuple(f"{toolkit_name(n)}:{suite}" for n in names)


def profile_layers(profile: str) -> dict[str, tuple[str, ...]]:
    """Toolchain -> the library layers ``profile`` stacks over it (InvalidSpec if unknown)."""
    try:
        return PROFILES[profile]
    except KeyError:
        raise InvalidSpec(f"unknown profile {profile!r}: choose from {', '.join(PROFILES)}",
                          field="profile") from None


def parse_toolchains(spec: str | Iterable[str], profile: str | None = None) -> list[str]:
    """``"python,cpp"`` (or ``"all"``) -> toolchain names, checked, in table order (which
    puts a library layer after the toolkit it is built over). With ``profile``, the library
    layers it stacks over the named toolchains (and the toolkits those are built over) too."""
    words = [w.strip() for w in (spec.split(",") if isinstance(spec, str) else spec) if w.strip()]
    if not words:
        raise InvalidSpec("no toolchain named: give e.g. --toolchains python,cpp (or all)", field="toolchains")
    extra = profile_layers(profile) if profile else {}
    if "all" in words:
        words = [t for t in TOOLCHAINS if TOOLCHAINS[t].over is None]
    unknown = [w for w in words if w not in TOOLCHAINS]
    if unknown:
        raise InvalidSpec(f"unknown toolchain {unknown[0]!r}: choose from {', '.join(TOOLCHAINS)} (or all)",
                          field="toolchains")
    chosen = set(words)
    for w in words:
        chosen.update(extra.get(w, ()))
    chosen.update({o for t in chosen if (o := TOOLCHAINS[t].over) is not None})
    return [t for t in TOOLCHAINS if t in chosen]


@dataclass(frozen=True)
class Built:
    """One layer of a :func:`build_toolchains` run: built now, or kept from before."""

    toolchain: str  # "base" for tc-base
    layer: Layer | None  # None: the toolchain needs no toolkit (bash)
    built: bool


def build_toolchains(
    store: LayerStore,
    toolchains: Sequence[str],
    *,
    suite: str = DEFAULT_SUITE,
    mirror: str | None = None,
    rebuild: bool = False,
    apt_options: Sequence[str] = (),
    progress: Progress | None = None,
    profile: str | None = None,
) -> list[Built]:
    """Make sure ``tc-base:<suite>`` and the toolkits of ``toolchains`` exist and are current.

    The base is built when missing (or with ``rebuild``); each toolkit when missing, when it
    was built on another base (a library layer: on other lowers), or with ``rebuild``.
    ``profile`` adds the library layers it stacks over those toolchains (PROFILES).
    ``apt_options`` go to apt-get as ``-o`` (e.g. ``Acquire::http::Proxy=http://...``).
    Returns the base first, then the toolkits."""
    from .build import _noop, build_debootstrap
    from .debootstrap import check_args

    names = parse_toolchains(toolchains, profile)
    check_args(suite, "minbase", ())
    for o in apt_options:
        if "=" not in o or "\n" in o:
            raise InvalidSpec(f"bad apt option {o!r}: give KEY=VALUE", field="apt_options")
    report = progress or _noop
    base_ref = f"{BASE_NAME}:{suite}"
    base: Layer | None = None
    if not rebuild:
        try:
            base = store.resolve(base_ref)
        except LayerNotFound:
            base = None
    out: list[Built] = []
    if base is None:
        base = build_debootstrap(store, suite=suite, variant="minbase", name=BASE_NAME, tag=suite,
                                 mirror=mirror, progress=report)
        out.append(Built("base", base, True))
    else:
        out.append(Built("base", base, False))
    made: dict[str, Layer] = {}
    for name in names:
        tc = TOOLCHAINS[name]
        if not tc.packages:
            out.append(Built(name, None, False))
            continue
        lowers = (base,) if tc.over is None else (base, made[tc.over])  # table order: `over` came first
        ref = f"{toolkit_name(name)}:{suite}"
        current: Layer | None = None
        if not rebuild:
            try:
                current = store.resolve(ref)
            except LayerNotFound:
                current = None
        wanted = tuple(lay.digest for lay in lowers)
        if current is not None and tuple(current.parents[:len(wanted)]) == wanted:
            made[name] = current
            out.append(Built(name, current, False))
            continue
        made[name] = build_toolkit(store, lowers, tc, suite=suite, apt_options=apt_options, progress=report)
        out.append(Built(name, made[name], True))
    return out


def copy_toolchains(src: LayerStore, dst: LayerStore, toolchains: Sequence[str], *,
                    suite: str = DEFAULT_SUITE, profile: str | None = None) -> list[Layer]:
    """Put ``tc-base:<suite>`` and the toolkits of ``toolchains`` (with ``profile``'s library
    layers) from ``src`` into ``dst`` (same digests, names and lineage; a copy of each file).
    LayerNotFound when ``src`` lacks one: build them there first (:func:`build_toolchains`)."""
    from .layer import LayerKind

    base = src.resolve(f"{BASE_NAME}:{suite}")
    out = [dst.add_erofs(Path(src.open_local(base.digest)), name=BASE_NAME, tag=suite, kind=LayerKind.BASE)]
    for name in parse_toolchains(toolchains, profile):
        if not TOOLCHAINS[name].packages:
            continue
        layer = src.resolve(f"{toolkit_name(name)}:{suite}")
        out.append(dst.add_erofs(Path(src.open_local(layer.digest)), name=layer.name, tag=suite,
                                 kind=LayerKind.TOOLKIT, parents=layer.parents))
    return out


def build_toolkit(
    store: LayerStore,
    lowers: Layer | Sequence[Layer],
    toolchain: Toolchain,
    *,
    suite: str,
    apt_options: Sequence[str] = (),
    progress: Progress | None = None,
) -> Layer:
    """``tc-<name>:<suite>``: the diff ``toolchain.packages`` make over ``lowers`` (the base,
    then for a library layer the toolkit it goes over), as a toolkit layer whose parents are
    those lowers."""
    if not isinstance(lowers, Sequence):
        lowers = (lowers,)
    from .build import _noop, _to_layer
    from .debootstrap import scrub_build_host, slim_rootfs
    from .diff import apply_diff, open_dir
    from .layer import LayerKind

    report = progress or _noop
    stage = f"apt: {toolchain.name}"
    with store.scratch("toolchain") as scratch:
        work = scratch / "overlay"
        work.mkdir()
        _install([Path(store.open_local(lay.digest)) for lay in lowers], work, toolchain.packages, apt_options,
                 lambda n: report(stage, n, None))
        upper = work / "upper"
        report("slim", 0, None)
        slim_rootfs(upper)
        scrub_build_host(upper, add_missing=False)  # the base layer has its /etc/hosts
        # A plain copy of the diff: overlayfs's own bookkeeping (trusted.overlay.origin,
        # impure...) describes the build's stack and is left behind; whiteouts stay.
        tree = scratch / "rootfs"
        tree.mkdir()
        fd = open_dir(upper)
        try:
            stats = apply_diff(fd, tree)
        finally:
            os.close(fd)
        report("slim", 1, 1)
        log.info("toolchain %s: %d files, %d whiteouts, %d bytes over %s", toolchain.name, stats.files,
                 stats.whiteouts, stats.bytes, " + ".join(lay.ref for lay in lowers))
        return _to_layer(store, tree, scratch, name=toolkit_name(toolchain.name), tag=suite,
                         kind=LayerKind.TOOLKIT, parents=tuple(lay.digest for lay in lowers), progress=report)


_PACKAGE_DONE = re.compile(r"^(Setting up|Unpacking) ")


def _install(lower_files: Sequence[Path], work: Path, packages: Sequence[str], apt_options: Sequence[str],
             on_package: Callable[[int], None]) -> None:
    """Run chroot_apt.py in fresh mount and pid namespaces; its output's tail goes into the error."""
    if os.geteuid() != 0:
        raise HostError("building a toolchain needs root (a mount namespace and chroot)")
    unshare = shutil.which("unshare")
    if unshare is None or shutil.which("chroot") is None:
        raise HostError("unshare and chroot are needed: apt-get install util-linux coreutils", binary="unshare")
    cmd = [unshare, "--mount", "--pid", "--fork", "--propagation", "private", "--",
           sys.executable, "-m", "dsec.images.chroot_apt", *[f"--base={f}" for f in lower_files], "--dir", str(work),
           "--packages", ",".join(packages), *[f"--apt-option={o}" for o in apt_options]]
    tail: deque[str] = deque(maxlen=30)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True,
                            env={**os.environ, "PYTHONPATH": _package_root()})
    timer = threading.Timer(INSTALL_TIMEOUT_S, proc.kill)
    timer.daemon = True
    timer.start()
    done = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if _PACKAGE_DONE.match(line):
                done += 1
                on_package(done)
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc != 0:
        from .errors import LayerBuildError

        raise LayerBuildError(
            f"installing {', '.join(packages)} over the base failed (exit {rc}):\n" + "\n".join(tail)
            + "\nCheck the package names and that the mirror in the base's /etc/apt/sources.list is reachable "
              "(--mirror when building the base; --apt-option for a proxy).",
            stage="apt", returncode=rc)


def _package_root() -> str:
    """The directory holding the ``dsec`` package, so the helper imports this very copy."""
    return str(Path(__file__).resolve().parents[2])


__all__ = ["BASE_NAME", "DEFAULT_SUITE", "PROFILES", "TOOLCHAINS", "Built", "Toolchain", "build_toolchains", "build_toolkit",
           "copy_toolchains",
           "image_for", "parse_toolchains", "profile_layers", "toolkit_name"]
