"""A node's registry layers: names looked up in one OCI registry, bytes loaded lazily.

:class:`RegistryLayers` is the :class:`~dsec.images.store.RemoteSource` an edge gives its
layer store when ``EdgeConfig.registry`` is set:

- **Names.** A ``name:tag`` the store does not hold is looked up as the DSec layer
  ``<registry>/<namespace>/<name>:<tag>`` (the repository a user pushed it to with
  ``dsec image push name:tag --registry HOST/<namespace>/<name>``; without a namespace,
  ``HOST/<name>``). Found, it is registered in the store as a *remote* layer: its index
  rows and chunk table, no bytes. With ``lazy=False`` the whole layer is pulled instead.
- **Bytes.** Mounting a remote layer attaches it to the node's one FUSE process
  (:class:`~dsec.images.lazy.LazyLayers`), which fetches chunks on first read; the store
  gives the runtime that file, and EROFS is mounted from it as from a local one. When
  the last mount of the layer goes, the file is detached (its cached chunks stay).
- **Auth.** Range requests carry the headers the registry client worked out
  (anonymous, basic or a bearer token). Bearer tokens expire: :meth:`refresh` (the
  edge runs it every ``refresh_interval_s``) attaches every layer again with fresh ones.
- **Failures.** A registry that cannot be asked makes ``lookup`` and ``attach`` raise
  :class:`~dsec.errors.LayerUnavailable` (HTTP 503), which refuses the create; chunks
  already cached keep serving. :meth:`heal` restarts a dead FUSE process and detaches
  the EROFS mounts made from its files (the runtime's self-check mounts them again from
  the new process); sandboxes that were reading from the dead files get EIO.

Blocking calls throughout (registry HTTP, the FUSE process's control socket): async
callers run them in a worker thread. Thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dsec.errors import LayerUnavailable

from . import sysmount
from .errors import RegistryAuthError, RegistryError, RegistryNotFound, RegistryUnreachable
from .layer import Layer, check_name, check_tag
from .lazy import LayerBusy, LazyLayers, RemoteLayer, ServiceDown
from .registry import Credentials, RegistryClient, RegistryRef
from .store import LocalLayerStore, MountSource, RemoteRecord
from .transfer import pull_layer, read_dsec_layer

log = logging.getLogger("dsec.images.remote")


@dataclass
class HealReport:
    restarted: bool = False
    """The FUSE process was dead and a new one was started."""
    detached_mounts: list[str] = field(default_factory=list)
    """EROFS mounts made from the dead process's files, detached so they are mounted again."""
    problem: str = ""
    """What could not be repaired ("" when all is well)."""


@dataclass(frozen=True)
class _Attached:
    parts: list[RemoteLayer]
    """The files of one layer in the FUSE process: [EROFS file] or [metadata image, data device]."""


class RegistryLayers:
    """The store's registry door and the node's lazy loader; see the module docstring."""

    def __init__(
        self,
        store: LocalLayerStore,
        url: str,
        *,
        namespace: str = "",
        credentials: Credentials | None = None,
        lazy: LazyLayers | None = None,
        timeout_s: float = 30.0,
        verify: bool | str = True,
    ) -> None:
        self.store = store
        self.url = url.rstrip("/")
        self.namespace = namespace.strip("/")
        self.lazy = lazy
        """None: registry layers are pulled whole on first use (``lazy: false``)."""
        self.client = RegistryClient(self.url, credentials=credentials, timeout=timeout_s, verify=verify)
        self._lock = threading.Lock()
        self._attached: dict[str, _Attached] = {}
        """Layer digest -> its files (with the headers last sent) attached to the FUSE process."""
        self.lookups = 0
        self.lookup_misses = 0
        self.registry_failures = 0
        self.last_failure = ""
        self.last_failure_at = 0.0
        self.restarts = 0

    def __repr__(self) -> str:
        return f"RegistryLayers({self.url!r}, namespace={self.namespace!r}, lazy={self.lazy is not None})"

    # ------------------------------------------------------------ lifetime --

    def start(self) -> None:
        """Start (or adopt) the FUSE process and become the store's remote source."""
        if self.lazy is not None:
            self.lazy.start()
        self.store.set_remote_source(self)

    def close(self, *, stop_loader: bool) -> None:
        """Stop being the store's source; with ``stop_loader`` also stop the FUSE process
        (only once no EROFS mount uses its files: an edge that keeps its sandboxes across a
        restart leaves it running, and the next edge adopts it)."""
        if self.store.remote_source is self:
            self.store.set_remote_source(None)
        if stop_loader and self.lazy is not None:
            self.lazy.close()
        self.client.close()

    # --------------------------------------------------------------- names --

    def repo_for(self, name: str) -> str:
        return f"{self.namespace}/{name}" if self.namespace else name

    def describe(self, name: str, tag: str) -> str:
        return f"in the registry {self.url} (as {self.repo_for(name)}:{tag})"

    def lookup(self, name: str, tag: str) -> Layer | None:
        check_name(name)
        check_tag(tag)
        repo = self.repo_for(name)
        self.lookups += 1
        try:
            if self.lazy is None:
                ref = RegistryRef(base_url=self.url, repo=repo, tag=tag)
                return pull_layer(self.store, self.client, ref, name=name, tag=tag)
            _, cfg = read_dsec_layer(self.client, repo, tag)
        except RegistryNotFound:
            self.lookup_misses += 1
            return None
        except RegistryError as exc:
            raise self._unavailable(exc, f"looking up {repo}:{tag}") from exc
        remote = RemoteLayer.from_config(cfg.model_dump(mode="json"), registry=self.url, repo=repo)
        lazy = None
        if cfg.lazy is not None:
            lazy = (RemoteLayer(registry=self.url, repo=repo, **cfg.lazy.meta.model_dump()),
                    RemoteLayer(registry=self.url, repo=repo, prefetch=cfg.lazy.prefetch, extents=cfg.lazy.extents,
                                **cfg.lazy.data.model_dump()))  # fmt: skip
        layer = self.store.add_remote(remote, name=name, tag=tag, kind=cfg.kind, parents=cfg.parents, lazy=lazy)
        log.info("registry layer %s:%s is %s (%d bytes, %d chunks) from %s/%s", name, tag, cfg.digest,
                 cfg.size, len(cfg.chunks), self.url, repo)  # fmt: skip
        return layer

    # --------------------------------------------------------------- bytes --

    def attach(self, rec: RemoteRecord) -> MountSource:
        """Attach the layer's lazy form (metadata image fetched whole, data device on demand)
        or, for a layer pushed without one, its EROFS file (metadata chunks first)."""
        remote = rec.layer
        if self.lazy is None:
            raise LayerUnavailable(
                f"layer {remote.digest} is a registry layer ({remote.registry}/{remote.repo}) and this "
                "edge loads registry layers whole (registry.lazy: false): `dsec image pull` it",
                digest=remote.digest, registry=remote.registry, status=0,
            )  # fmt: skip
        headers = self._headers(remote)
        parts = ([remote] if rec.meta is None or rec.data is None else [rec.meta, rec.data])
        refs = [p.model_copy(update={"headers": headers}) for p in parts]
        paths = []
        for i, ref in enumerate(refs):
            # a lazy form: its metadata image whole, its data device nothing ahead
            kw: dict[str, Any] = ({} if len(refs) == 1 else {"prefetch_all": True} if i == 0 else
                                  {"prefetch_metadata": False, "extents_of": refs[0].digest})  # fmt: skip
            try:
                try:
                    paths.append(self.lazy.attach(ref, **kw))
                except ServiceDown:
                    self.heal()  # the process died: start a new one and try once more
                    paths.append(self.lazy.attach(ref, **kw))
            except LayerUnavailable as exc:
                self.note_failure(str(exc))
                raise
        with self._lock:
            self._attached[remote.digest] = _Attached(refs)
        if len(paths) == 1:
            return MountSource(paths[0])
        return MountSource(paths[0], f"device={paths[1]}")

    def detach(self, digest: str) -> None:
        with self._lock:
            known = self._attached.pop(digest, None)
        if self.lazy is None or known is None:
            return
        for part in known.parts:
            try:
                self.lazy.detach(part.digest)
            except LayerBusy:
                log.info("layer %s: its lazy file %s is still open (a mount elsewhere); left attached",
                         digest, part.digest)  # fmt: skip
            except ServiceDown:
                pass  # nothing to detach from; heal() starts a new process without it

    def attached(self) -> list[str]:
        with self._lock:
            return sorted(self._attached)

    def _headers(self, remote: RemoteLayer) -> dict[str, str]:
        if remote.registry != self.url:
            raise LayerUnavailable(
                f"layer {remote.digest} comes from {remote.registry}, but this edge's registry is {self.url}: "
                "configure that registry, or push the layer to this one",
                digest=remote.digest, registry=remote.registry, status=0,
            )  # fmt: skip
        try:
            return self.client.auth_headers(remote.repo)
        except RegistryError as exc:
            raise self._unavailable(exc, f"authorising reads of {remote.repo}", digest=remote.digest) from exc

    def refresh(self) -> int:
        """Attach every attached layer again if its auth headers changed (an expiring bearer
        token); returns how many were refreshed. Failures are counted, not raised."""
        if self.lazy is None:
            return 0
        with self._lock:
            attached = list(self._attached.items())
        done = 0
        for digest, att in attached:
            repo = att.parts[0].repo
            try:
                headers = self.client.auth_headers(repo)
                if headers == att.parts[0].headers:
                    continue
                fresh = [p.model_copy(update={"headers": headers}) for p in att.parts]
                for p in fresh:
                    self.lazy.attach(p, prefetch_metadata=False)
                with self._lock:
                    if digest in self._attached:
                        self._attached[digest] = _Attached(fresh)
                done += 1
            except (RegistryError, LayerUnavailable, ServiceDown) as exc:
                self.note_failure(f"refreshing the token of {repo}: {exc}")
        return done

    # -------------------------------------------------------------- health --

    def heal(self) -> HealReport:
        """Restart a dead FUSE process and detach the EROFS mounts made from its files."""
        report = HealReport()
        if self.lazy is None:
            return report
        if self.lazy.reconcile().alive:
            return report
        # reconcile() above unmounted the dead FUSE mount; the EROFS mounts made from its
        # files are dead too. Detach them: the runtime's check mounts them again.
        prefix = str(self.lazy.mountpoint) + "/"
        for m in sysmount.mountinfo():
            if m.fstype == "erofs" and m.source.startswith(prefix):
                with contextlib.suppress(OSError):
                    sysmount.umount(m.mount_point, sysmount.MNT_DETACH)
                    report.detached_mounts.append(m.mount_point)
                    with contextlib.suppress(OSError):
                        os.rmdir(m.mount_point)
        try:
            self.lazy.start()
        except ServiceDown as exc:
            report.problem = f"the lazy layer process cannot be started: {exc}"
            return report
        report.restarted = True
        self.restarts += 1
        log.warning("restarted the lazy layer process (pid %s); detached %d stale layer mount(s)",
                    self.lazy.pid, len(report.detached_mounts))  # fmt: skip
        self.refresh()
        return report

    def stats(self) -> dict[str, Any]:
        """For health and metrics: the loader's counters and ours. Never raises."""
        out: dict[str, Any] = {
            "registry": self.url, "lazy": self.lazy is not None, "lookups": self.lookups,
            "lookup_misses": self.lookup_misses, "registry_failures": self.registry_failures,
            "last_failure": self.last_failure, "restarts": self.restarts, "attached": len(self.attached()),
        }  # fmt: skip
        if self.lazy is not None:
            try:
                s = self.lazy.stats()
                out["loader"] = {k: s.get(k) for k in (
                    "reads", "read_bytes", "chunks_fetched", "bytes_fetched", "read_errors", "read_timeouts",
                    "corrupt_chunks", "registry_errors", "inflight", "prefetch_chunks")}  # fmt: skip
                out["loader"]["cache"] = s.get("cache", {})
                out["corrupt_events"] = s.get("corrupt_events", [])
                out["up"] = True
            except (ServiceDown, OSError) as exc:
                out["up"] = False
                out["down_reason"] = str(exc)
        return out

    def recently_failed(self, within_s: float = 60.0) -> bool:
        return bool(self.last_failure) and time.time() - self.last_failure_at < within_s

    # ----------------------------------------------------------- internals --

    def note_failure(self, message: str) -> None:
        """Count a failure of the registry and remember it (health says so for a minute)."""
        self.registry_failures += 1
        self.last_failure, self.last_failure_at = message, time.time()

    def _unavailable(self, exc: RegistryError, what: str, *, digest: str = "") -> LayerUnavailable:
        status = int(getattr(exc, "status", 0) or 0)
        self.note_failure(f"{what}: {exc}")
        kind = ("cannot reach" if isinstance(exc, RegistryUnreachable) else
                "was refused by" if isinstance(exc, RegistryAuthError) else "failed at")  # fmt: skip
        return LayerUnavailable(
            f"{what} {kind} the registry {self.url}: {exc}; the edge cannot load layers it does not "
            "hold until the registry answers (check `registry.url` and its credentials in the edge config)",
            digest=digest, registry=self.url, status=status,
        )  # fmt: skip


__all__ = ["HealReport", "RegistryLayers"]
