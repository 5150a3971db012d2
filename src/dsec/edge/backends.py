"""The backends one edge runs, and which of them holds which sandbox.

The edge talks to backends only through :class:`dsec.backends.base.Backend`;
this object builds them from ``EdgeConfig.backends`` (importing a backend's
code only when it is configured), starts and stops them together, and answers
"whose sandbox is this" for every request. A create never guesses:
``SandboxSpec.backend`` always names the backend (default ``container``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsec.backends import BackendContext, build
from dsec.backends.base import Backend, Capability, HostFinding, SandboxRecord
from dsec.errors import InvalidSpec, Unsupported
from dsec.images import sysmount

log = logging.getLogger("dsec.edge.backends")


class EdgeBackends:
    def __init__(self, configs: list[Any], *, runtime: str, state_dir: Path, run_dir: Path, edge_id: str,
                 registry: Any = None, max_sandboxes: int | None = None, platform: tuple[str, ...] = ()) -> None:
        self._configs = {c.kind: c for c in configs}
        self._max_sandboxes = max_sandboxes
        self._platform = platform
        self._registry_config = registry
        self.registry: Any = None
        """The store's :class:`~dsec.images.remote.RegistryLayers` when a registry is configured."""
        self.registry_findings: list[HostFinding] = []
        self.registry_problem = ""
        self._last_refresh = time.monotonic()
        self.registry_stats: dict[str, Any] = {}
        """The registry layers' counters as of the last self-check pass (metrics read them)."""
        self.corrupt_refused: list[dict[str, Any]] = []
        self._corrupt_seen: set[tuple[Any, Any, Any]] = set()
        self._runtime = runtime
        self._state_dir = state_dir
        self._run_dir = run_dir
        self._edge_id = edge_id
        self._store: Any = None
        self.by_kind: dict[str, Backend] = {}
        """Built backends, in configuration order."""
        self.edge_id = edge_id

    # ------------------------------------------------------------ building --

    @property
    def store(self) -> Any:
        """The layer store every backend of this edge reads images from."""
        if self._store is None:
            from dsec.images.store import LocalLayerStore

            self._store = LocalLayerStore(self._state_dir / "layers")
            if self._registry_config is not None:
                self.registry = self._registry_layers(self._store, self._registry_config)
        return self._store

    def _registry_layers(self, store: Any, cfg: Any) -> Any:
        from dsec.images.lazy import LazyLayers
        from dsec.images.registry import Credentials
        from dsec.images.remote import RegistryLayers

        credentials = None
        if cfg.username is not None:
            if cfg.password_file is None:
                raise InvalidSpec("registry.username needs registry.password_file (the password is never inline)",
                                  field="registry.password_file")
            try:
                password = Path(cfg.password_file).read_text().strip()
            except OSError as exc:
                raise InvalidSpec(f"cannot read registry.password_file {cfg.password_file}: {exc.strerror}",
                                  field="registry.password_file") from exc
            credentials = Credentials(cfg.username, password)
        lazy = None
        if cfg.lazy:
            lazy = LazyLayers(self._run_dir / f"lazy-{self._runtime}", cfg.cache_dir or self._state_dir / "chunks",
                              cache_limit_bytes=cfg.cache_limit_bytes, read_deadline_s=cfg.read_deadline_s,
                              fetch_attempts=cfg.fetch_attempts)
        return RegistryLayers(store, cfg.url, namespace=cfg.namespace, credentials=credentials, lazy=lazy,
                              timeout_s=cfg.timeout_s, verify=cfg.verify_tls)

    def name_for(self, kind: str) -> str:
        """The host-resource name of a backend: the edge's runtime name for the container
        backend (as before backends existed), ``<runtime>-<kind>`` for the others."""
        return self._runtime if kind == "container" else f"{self._runtime}-{kind}"[:32]

    def build_all(self) -> None:
        for kind, cfg in self._configs.items():
            if kind not in self.by_kind:
                ctx = BackendContext(name=self.name_for(kind), state_dir=self._state_dir, run_dir=self._run_dir,
                                     id_prefix=self._edge_id, store=self.store, backends=self.by_kind,
                                     max_sandboxes=self._max_sandboxes, platform=self._platform)
                self.by_kind[kind] = build(cfg, ctx)

    async def start(self) -> None:
        self.build_all()
        if self.registry is not None:
            await asyncio.to_thread(self.registry.start)
        started: list[Backend] = []
        try:
            # Backends that run on others (FnCall's workers are container sandboxes) start last.
            for b in sorted(self.by_kind.values(), key=lambda b: b.capabilities.kind == "fncall"):
                await b.start()
                started.append(b)
        except BaseException:
            for b in reversed(started):
                with contextlib.suppress(Exception):
                    await b.close(destroy_all=False)
            await self._close_registry()
            raise

    async def close(self, *, destroy_all: bool) -> None:
        for b in sorted(self.by_kind.values(), key=lambda b: b.capabilities.kind != "fncall"):
            try:
                await b.close(destroy_all=destroy_all)
            except Exception:
                log.exception("closing the %s backend failed", b.capabilities.kind)
        await self._close_registry()

    async def _close_registry(self) -> None:
        """Stop the lazy loader once no layer mount uses its files; otherwise leave it running
        for the sandboxes that survive this edge (the next edge adopts it)."""
        reg = self.registry
        if reg is None:
            return
        in_use = reg.lazy is not None and any(
            m.fstype == "erofs" and m.source.startswith(f"{reg.lazy.mountpoint}/") for m in sysmount.mountinfo())
        try:
            await asyncio.to_thread(reg.close, stop_loader=not in_use)
        except Exception:
            log.exception("closing the registry layers failed")

    # ------------------------------------------------------------- lookups --

    def kinds(self) -> list[str]:
        return list(self._configs)

    def capabilities(self) -> dict[str, list[str]]:
        """Per backend kind, the operations it offers (advertised to the control plane)."""
        self.build_all()
        return {k: b.capabilities.names() for k, b in self.by_kind.items()}

    def facts(self) -> dict[str, dict[str, str]]:
        """Per backend kind that states them, what it runs on (the microVM backend: its
        accelerator ``vm_accel`` and why, QEMU's build, the guest kernel)."""
        out: dict[str, dict[str, str]] = {}
        for k, b in self.by_kind.items():
            facts = getattr(b, "facts", None)
            if callable(facts):
                out[k] = {str(key): str(v) for key, v in facts().items()}
        return out

    def get(self, kind: str) -> Backend:
        """The backend of this kind; ``Unsupported`` if this edge does not run it."""
        b = self.by_kind.get(kind)
        if b is None:
            raise Unsupported(
                f"edge {self.edge_id} does not run the {kind} backend (it runs: {', '.join(self._configs)}); "
                "the control plane places a sandbox on an edge that runs its backend",
                operation="create", backend=kind, edge_id=self.edge_id,
            )
        return b

    def sandbox_backends(self) -> Iterator[Backend]:
        for b in self.by_kind.values():
            if b.capabilities.supports(Capability.SANDBOXES):
                yield b

    def find(self, sandbox_id: str) -> tuple[Backend, SandboxRecord] | None:
        for b in self.sandbox_backends():
            rec = b.sandboxes.get(sandbox_id)
            if rec is not None:
                return b, rec
        return None

    def record(self, sandbox_id: str) -> SandboxRecord | None:
        found = self.find(sandbox_id)
        return None if found is None else found[1]

    def backend_of(self, sandbox_id: str) -> Backend | None:
        found = self.find(sandbox_id)
        return None if found is None else found[0]

    def records(self) -> Iterator[SandboxRecord]:
        for b in self.sandbox_backends():
            yield from list(b.sandboxes.values())

    def count(self) -> int:
        return sum(len(b.sandboxes) for b in self.sandbox_backends())

    def holds(self, sandbox_id: str) -> bool:
        return any(sandbox_id in b.sandboxes for b in self.sandbox_backends())

    # ----------------------------------------------------------- activity --

    def last_activity(self, sandbox_id: str) -> float | None:
        b = self.backend_of(sandbox_id)
        return None if b is None else b.last_activity.get(sandbox_id)

    def touch(self, sandbox_id: str) -> None:
        b = self.backend_of(sandbox_id)
        if b is not None:
            b.last_activity[sandbox_id] = time.monotonic()

    # --------------------------------------------------------------- host --

    def reconciled(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for b in self.by_kind.values():
            for k, v in b.reconciled.items():
                out.setdefault(k, []).extend(v)
        return out

    async def heal(self) -> None:
        if self.registry is not None:
            await self._heal_registry()
        for b in self.by_kind.values():
            await b.heal()

    async def _heal_registry(self) -> None:
        """Restart a dead lazy loader (its stale layer mounts are detached first, so the
        backends' heal below mounts them again) and refresh expiring registry tokens."""
        reg = self.registry
        report = await asyncio.to_thread(reg.heal)
        if report.restarted:
            self.registry_findings.append(HostFinding(
                "lazy_loader", f"restarted the lazy layer process (pid {reg.lazy.pid}); detached "
                f"{len(report.detached_mounts)} stale layer mount(s)", repaired=True))
            del self.registry_findings[:-50]
        self.registry_problem = report.problem
        await asyncio.to_thread(self._audit_registry)
        now = time.monotonic()
        if now - self._last_refresh >= self._registry_config.refresh_interval_s:
            self._last_refresh = now
            await asyncio.to_thread(reg.refresh)

    def _audit_registry(self) -> None:
        """Keep the loader's counters for metrics; say each new refused chunk in the edge's log."""
        stats = self.registry.stats()
        errors = int(stats.get("loader", {}).get("registry_errors") or 0)
        before = int(self.registry_stats.get("loader", {}).get("registry_errors") or 0)
        if self.registry_stats and errors > before:
            self.registry.note_failure(f"{errors - before} chunk fetch attempt(s) failed since the last check")
        self.registry_stats = stats
        for ev in stats.get("corrupt_events", []):
            key = (ev.get("digest"), ev.get("chunk"), ev.get("at"))
            if key in self._corrupt_seen:
                continue
            self._corrupt_seen.add(key)
            self.corrupt_refused.append(ev)
            del self.corrupt_refused[:-20]
            log.warning("AUDIT registry chunk refused (digest mismatch): %s", ev)

    def registry_problems(self) -> list[str]:
        """What makes the edge degraded about its registry: the loader down, or the registry
        failing recently (creates needing uncached layers are refused meanwhile)."""
        reg = self.registry
        if reg is None:
            return []
        out = [self.registry_problem] if self.registry_problem else []
        if reg.recently_failed():
            out.append(f"registry {reg.url} failing: {reg.last_failure}")
        if self.registry_stats.get("up") is False:
            out.append(f"lazy layer process down: {self.registry_stats.get('down_reason', '')}")
        recent = [ev for ev in self.corrupt_refused if time.time() - float(ev.get("at") or 0) < 600]
        if recent:
            out.append(f"{len(recent)} chunk(s) from {reg.url} refused in the last 10 min (digest mismatch): "
                       f"latest {recent[-1]}")
        return out

    def host_repairs(self) -> list[HostFinding]:
        out = [f for b in self.by_kind.values() for f in b.host_repairs] + self.registry_findings
        return sorted(out, key=lambda f: f.at)

    def store_space(self) -> tuple[int, int] | None:
        for b in self.by_kind.values():
            space = b.store_space()
            if space is not None:
                return space
        return None
