"""The backends one edge runs, and which of them holds which sandbox.

The edge talks to backends only through :class:`dsec.backends.base.Backend`;
this object builds them from ``EdgeConfig.backends`` (importing a backend's
code only when it is configured), starts and stops them together, and answers
"whose sandbox is this" for every request. A create never guesses:
``SandboxSpec.backend`` always names the backend (default ``container``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsec.backends import BackendContext, build
from dsec.backends.base import Backend, Capability, HostFinding, SandboxRecord
from dsec.errors import Unsupported

log = logging.getLogger("dsec.edge.backends")


class EdgeBackends:
    def __init__(self, configs: list[Any], *, runtime: str, state_dir: Path, run_dir: Path, edge_id: str) -> None:
        self._configs = {c.kind: c for c in configs}
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
        return self._store

    def name_for(self, kind: str) -> str:
        """The host-resource name of a backend: the edge's runtime name for the container
        backend (as before backends existed), ``<runtime>-<kind>`` for the others."""
        return self._runtime if kind == "container" else f"{self._runtime}-{kind}"[:32]

    def build_all(self) -> None:
        for kind, cfg in self._configs.items():
            if kind not in self.by_kind:
                ctx = BackendContext(name=self.name_for(kind), state_dir=self._state_dir, run_dir=self._run_dir,
                                     id_prefix=self._edge_id, store=self.store, backends=self.by_kind)
                self.by_kind[kind] = build(cfg, ctx)

    async def start(self) -> None:
        self.build_all()
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
            raise

    async def close(self, *, destroy_all: bool) -> None:
        for b in sorted(self.by_kind.values(), key=lambda b: b.capabilities.kind != "fncall"):
            try:
                await b.close(destroy_all=destroy_all)
            except Exception:
                log.exception("closing the %s backend failed", b.capabilities.kind)

    # ------------------------------------------------------------- lookups --

    def kinds(self) -> list[str]:
        return list(self._configs)

    def capabilities(self) -> dict[str, list[str]]:
        """Per backend kind, the operations it offers (advertised to the control plane)."""
        self.build_all()
        return {k: b.capabilities.names() for k, b in self.by_kind.items()}

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
        for b in self.by_kind.values():
            await b.heal()

    def host_repairs(self) -> list[HostFinding]:
        out = [f for b in self.by_kind.values() for f in b.host_repairs]
        return sorted(out, key=lambda f: f.at)

    def store_space(self) -> tuple[int, int] | None:
        for b in self.by_kind.values():
            space = b.store_space()
            if space is not None:
                return space
        return None
