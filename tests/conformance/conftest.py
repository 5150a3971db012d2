"""The backend conformance suite: one set of cases, run against every backend this machine can run.

The cases call the :class:`dsec.backends.base.Backend` protocol directly (no HTTP, no edge):
what any backend must do the same way, so the edge can treat them alike. They are in the
``test_*.py`` files beside this one; docs/BACKENDS.md ("Conformance") lists them.

- The ``backend`` fixture yields a started backend per kind, one per test module: its own
  :class:`~dsec.backends.BackendContext` named ``<RT_PREFIX>-cf<kind>-<module>`` (so the
  session leak check of tests/conftest.py covers it) over a layer store holding the busybox
  test layer (``busybox:test``). ``container`` always; ``gvisor`` once ``runsc`` is on PATH
  and :func:`dsec.backends.build` accepts a ``GVisorConfig`` (until then it skips with the
  reason build gave). A new backend is one entry in :data:`KINDS`. A module that needs more
  than the default config defines ``configure(kind) -> config`` (test_network.py: named
  permissions); its backend is built from that.
- ``@pytest.mark.requires(Capability.X)`` on a case: it skips with "backend <kind> does not
  declare <cap>" on a backend that lacks X. Its twin, ``test_capabilities.py``, calls every
  undeclared operation and expects :class:`~dsec.errors.Unsupported`, nothing else.
  :data:`REQUIRED` are the capabilities every sandbox backend must declare: the operations
  :class:`~dsec.backends.base.BackendBase` gives no refusing default.
- A backend bug the suite found is listed in :data:`KNOWN_BUGS` by (kind, case): that case
  runs as a strict xfail with the precise reason, so the fix shows up as a failure to clean.
- A failing case prints a trail: each sandbox it made, its state, events and usage.
- Leaving a module, its backend is closed and must have left nothing naming it or any of
  its sandboxes on the host (processes, mounts, cgroups, files): :func:`traces`.

Never blocks on a hung backend: every call goes through :meth:`BackendHarness.run` with a
deadline, and every case has a pytest-timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from dsec.backends.base import Capabilities, Capability

T = TypeVar("T")

IMAGE = "busybox:test"
CGROUP_ROOT = Path("/sys/fs/cgroup")

REQUIRED: frozenset[Capability] = frozenset({Capability.SANDBOXES, Capability.EXEC})
"""Every sandbox backend declares these: create/destroy/get/list, exec and usage have no
``Unsupported`` default in BackendBase. Cases marked with any other capability are optional."""


def _container_config() -> Any:
    from dsec.backends.container.config import ContainerConfig

    return ContainerConfig()


def _gvisor_config() -> Any:
    if shutil.which("runsc") is None:
        pytest.skip("runsc is not on PATH")
    from dsec.backends.gvisor.config import GVisorConfig

    return GVisorConfig()


def _microvm_config() -> Any:
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (scripts/setup.sh installs QEMU 10 from bookworm-backports)")
    from dsec.backends.microvm.config import MicroVMConfig

    return MicroVMConfig()


KINDS: dict[str, Callable[[], Any]] = {"container": _container_config, "gvisor": _gvisor_config,
                                       "microvm": _microvm_config}
"""Each backend kind and how to make its (default) config; skips when the host cannot run it."""

KNOWN_BUGS: dict[tuple[str, str], str] = {
}
"""Backend bugs this suite found, by (kind, case): those cases are expected to fail (strict: once
fixed they pass, and the run says to drop the entry)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "requires(capability): a conformance case for backends that declare this dsec Capability; "
        "skipped on the others (test_capabilities.py checks those refuse it with Unsupported)",
    )


# ------------------------------------------------------------ host scans ----


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def processes_matching(needle: str) -> dict[int, str]:
    """Host processes (any pid namespace) whose cgroup path or command line contains ``needle``."""
    out: dict[int, str] = {}
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        stat = _read(f"/proc/{pid}/stat")
        if not stat or stat[stat.rindex(b")") + 2:].split()[:1] in ([b"Z"], [b"X"]):
            continue  # gone or a zombie: holds nothing
        cmd = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
        cg = _read(f"/proc/{pid}/cgroup").decode(errors="replace")
        if needle in cg or needle in cmd:
            out[pid] = cmd
    return out


def host_processes_running(argv: list[str]) -> list[int]:
    """Host processes (any pid namespace) whose whole argv is ``argv``."""
    want = "\0".join(argv).encode() + b"\0"
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and _read(f"/proc/{name}/cmdline") == want:
            stat = _read(f"/proc/{name}/stat")
            if stat and stat[stat.rindex(b")") + 2:].split()[:1] not in ([b"Z"], [b"X"]):
                out.append(int(name))
    return out


def cgroups_matching(needle: str) -> list[str]:
    out = []
    for top, dirs, _files in os.walk(CGROUP_ROOT):
        out += [os.path.join(top, d) for d in dirs if needle in d]
    return out


def mounts_matching(needle: str) -> list[str]:
    return [ln for ln in _read("/proc/self/mountinfo").decode(errors="replace").splitlines() if needle in ln]


def files_matching(needle: str, roots: list[Path], skip: list[Path]) -> list[str]:
    """Paths under ``roots`` whose name contains ``needle``, and small files that mention it."""
    out = []
    skipped = {str(p) for p in skip}
    for root in roots:
        for top, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if os.path.join(top, d) not in skipped]
            for n in dirs + files:
                p = os.path.join(top, n)
                if needle in n:
                    out.append(p)
                elif n in files and not os.path.islink(p):
                    with contextlib.suppress(OSError):
                        if os.path.getsize(p) <= 65536 and needle.encode() in _read(p):
                            out.append(f"{p} (mentions it)")
    return out


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


# --------------------------------------------------------------- harness ----


@dataclass(frozen=True)
class Kind:
    """A backend kind this machine can run: its config and what it declares."""

    name: str
    config: Any
    capabilities: Capabilities

    def declares(self, cap: Capability) -> bool:
        return self.capabilities.supports(cap)


class BackendHarness:
    """A started backend (``impl``, the protocol object) with its own event loop and sync helpers."""

    def __init__(self, kind: Kind, ctx: Any) -> None:
        self.kind = kind
        self.ctx = ctx
        self.impl: Any = None
        self.runner: asyncio.Runner | None = None
        self.made: list[str] = []
        """Every sandbox id created through this harness (for the trail and the final scan)."""

    @property
    def name(self) -> str:
        return str(self.ctx.name)

    def start(self) -> BackendHarness:
        from dsec.backends import build

        self.impl = build(self.kind.config, self.ctx)
        self.runner = asyncio.Runner()
        self.run(self.impl.start())
        return self

    def close(self, *, destroy_all: bool = True) -> None:
        if self.runner is None:
            return
        try:
            self.run(self.impl.close(destroy_all=destroy_all))
        finally:
            self.runner.close()
            self.runner = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        assert self.runner is not None, "backend harness is closed"
        return self.runner.run(asyncio.wait_for(coro, timeout))

    # -- sandboxes --

    def spec(self, *, env: dict[str, str] | None = None, **resources: Any) -> Any:
        from dsec.spec import ImageRef, Resources, SandboxSpec

        return SandboxSpec(image=ImageRef(base=IMAGE), resources=Resources(**resources), env=env or {},
                           backend=self.kind.name)

    def create(self, *, sandbox_id: str | None = None, spec: Any = None, **spec_kw: Any) -> Any:
        """A sandbox of ``spec`` (default: :meth:`spec` of ``spec_kw``), tracked for the trail and the scans."""
        assert spec is None or not spec_kw, "give a spec or its keywords, not both"
        rec = self.run(self.impl.create(spec if spec is not None else self.spec(**spec_kw), sandbox_id=sandbox_id))
        self.track(rec.id)
        return rec

    def track(self, sid: str) -> None:
        """Count a sandbox the backend made some other way (a fork's children) as made here."""
        self.made.append(sid)
        _TRAIL.append((self, sid))

    @contextlib.contextmanager
    def sandbox(self, **spec_kw: Any) -> Iterator[Any]:
        rec = self.create(**spec_kw)
        try:
            yield rec
        except BaseException:
            _SNAPSHOTS[rec.id] = self.trail(rec.id)
            raise
        finally:
            self.run(self.impl.destroy(rec.id))

    def sh(self, sid: str, cmd: str | list[str], **kw: Any) -> Any:
        kw.setdefault("timeout", 30)
        return self.run(self.impl.exec(sid, cmd, **kw))

    def ok(self, sid: str, cmd: str | list[str], **kw: Any) -> str:
        r = self.sh(sid, cmd, **kw)
        assert r.exit_code == 0, f"{cmd!r} in {sid}: exit={r.exit_code} signal={r.signal} stderr={r.stderr!r}"
        return str(r.stdout.decode())

    def sandbox_processes(self, sid: str, pattern: str) -> list[str]:
        """Command lines of processes inside ``sid`` that contain ``pattern``, seen from inside."""
        out = self.ok(sid, ["ps", "-o", "args"])
        return [ln.strip() for ln in out.splitlines()[1:] if pattern in ln and "ps -o args" not in ln]

    # -- host-side views --

    def traces(self, sid: str) -> list[str]:
        """Everything on the host that still names sandbox ``sid``: expected empty once destroyed."""
        left = [f"process {p}: {c}" for p, c in processes_matching(sid).items()]
        left += [f"mount {ln}" for ln in mounts_matching(sid)]
        left += [f"cgroup {p}" for p in cgroups_matching(sid)]
        store_root = getattr(self.ctx.store, "root", None)
        left += [f"file {p}" for p in files_matching(sid, [self.ctx.state_dir, self.ctx.run_dir],
                                                      skip=[store_root] if store_root else [])]
        return left

    def leftovers(self) -> list[str]:
        """What the closed backend still holds: processes, mounts and cgroups naming it, and
        traces of any sandbox it made."""
        left = [f"process {p}: {c}" for p, c in processes_matching(f"/{self.name}/").items()]
        left += [f"mount {ln}" for ln in mounts_matching(str(self.ctx.run_dir / self.name))]
        left += [f"mount {ln}" for ln in mounts_matching(str(self.ctx.state_dir) + "/")]
        left += [f"cgroup {p}" for p in cgroups_matching(self.name)]
        for sid in self.made:
            left += self.traces(sid)
        return left

    def trail(self, sid: str) -> str:
        if sid in _SNAPSHOTS and (self.impl is None or sid not in self.impl.sandboxes):
            return _SNAPSHOTS[sid] + "\n  (taken when the case failed; destroyed since)"
        lines = [f"sandbox {sid} (backend {self.kind.name}, context {self.name})"]
        rec = self.impl.sandboxes.get(sid) if self.impl is not None else None
        if rec is None:
            lines.append("  not in the backend any more (destroyed or never made)")
            return "\n".join(lines)
        lines.append(f"  state={rec.state.value} reason={rec.reason!r}")
        try:
            lines.append(f"  usage={self.impl.usage(sid)}")
        except Exception as exc:
            lines.append(f"  usage unavailable: {exc!r}")
        lines += [f"  event {json.dumps(ev, default=str)}" for ev in rec.events[-20:]]
        return "\n".join(lines)


def make_context(dsec_base: Path, name: str, busybox_seed: Path) -> Any:
    """A BackendContext named ``name`` whose store holds the busybox test layer. The run
    directory is the session's (uid slots are host-wide there); the state directory is
    ``state-<name>`` (the session leak check looks for records under ``state-*``)."""
    from dsec.backends import BackendContext
    from dsec.images import LocalLayerStore

    state = dsec_base / f"state-{name}"
    store = LocalLayerStore(state / "layers")
    store.add_erofs(busybox_seed, name="busybox", tag="test", kind="base")
    return BackendContext(name=name, state_dir=state, run_dir=dsec_base / "run", id_prefix="cf", store=store,
                          backends={})


def add_layer(h: BackendHarness, tree: dict[str, str], *, name: str, kind: str = "workspace",
              tmp: Path) -> str:
    """Build a layer of ``tree`` (path -> text; a path ending in ``.sh`` is executable) into the
    harness's store; returns its ``name:test`` reference for an :class:`~dsec.spec.ImageRef`."""
    from dsec.images import build_from_dir

    root = tmp / name
    for rel, text in tree.items():
        f = root / rel.lstrip("/")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
        f.chmod(0o755 if rel.endswith(".sh") else 0o644)
    build_from_dir(h.ctx.store, root, name=name, tag="test", kind=kind)
    return f"{name}:test"


def context_name(kind: str, suffix: str) -> str:
    from conftest import RT_PREFIX  # tests/conftest.py

    name = f"{RT_PREFIX}-cf{kind[:2]}-{suffix}"[:32]
    return name.rstrip("-_")


_TRAIL: list[tuple[BackendHarness, str]] = []
_SNAPSHOTS: dict[str, str] = {}


# -------------------------------------------------------------- fixtures ----


@pytest.fixture(scope="module", params=list(KINDS))
def backend_kind(request: pytest.FixtureRequest, dsec_base: Path) -> Kind:
    """A backend kind this machine can run (skips with the reason when it cannot)."""
    from dsec.backends import BackendContext, build

    name: str = request.param
    try:
        config = KINDS[name]()
        probe = build(config, BackendContext(name=context_name(name, "probe"), state_dir=dsec_base / "probe",
                                             run_dir=dsec_base / "run", id_prefix="cf", store=None, backends={}))
    except ValueError as exc:
        if "no backend of kind" not in str(exc):
            raise
        pytest.skip(str(exc))
    except ImportError as exc:
        pytest.skip(str(exc))
    return Kind(name, config, probe.capabilities)


@pytest.fixture(scope="module")
def backend(request: pytest.FixtureRequest, backend_kind: Kind, dsec_base: Path,
            busybox_seed: Path) -> Iterator[BackendHarness]:
    """One started backend of each kind per test module; it must leave nothing behind."""
    suffix = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")[:10]
    kind = backend_kind
    configure: Callable[[Kind], Any] | None = getattr(request.module, "configure", None)
    if configure is not None:  # a module that needs more than the default config (named permissions...)
        kind = Kind(kind.name, configure(kind), kind.capabilities)
    h = BackendHarness(kind, make_context(dsec_base, context_name(backend_kind.name, suffix), busybox_seed))
    h.start()
    try:
        yield h
    finally:
        h.close()
    assert wait_until(lambda: not h.leftovers(), timeout=5), f"backend {h.name} left: {h.leftovers()}"


@pytest.fixture(autouse=True)
def _declared(request: pytest.FixtureRequest) -> None:
    """Skip a case whose ``requires`` capability the backend under test does not declare."""
    marks = list(request.node.iter_markers("requires"))
    if not marks or "backend_kind" not in request.fixturenames:
        return
    kind: Kind = request.getfixturevalue("backend_kind")
    for mark in marks:
        for cap in mark.args:
            if not kind.declares(cap):
                pytest.skip(f"backend {kind.name} does not declare {Capability(cap).value}")


@pytest.fixture(autouse=True)
def _known_bug(request: pytest.FixtureRequest) -> None:
    if "backend_kind" not in request.fixturenames:
        return
    kind: Kind = request.getfixturevalue("backend_kind")
    reason = KNOWN_BUGS.get((kind.name, request.node.originalname))
    if reason is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


@pytest.fixture
def sb(backend: BackendHarness) -> Iterator[Any]:
    """A default sandbox for one case, destroyed afterwards."""
    with backend.sandbox() as rec:
        yield rec


def pytest_runtest_setup(item: pytest.Item) -> None:
    _TRAIL.clear()
    _SNAPSHOTS.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and _TRAIL:
        texts = []
        for harness, sid in _TRAIL:
            try:
                texts.append(harness.trail(sid))
            except Exception as exc:  # the trail must never hide the failure
                texts.append(f"sandbox {sid}: trail unavailable ({exc!r})")
        report.sections.append(("dsec conformance trail", "\n".join(texts)))
