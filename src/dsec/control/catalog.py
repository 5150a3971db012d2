"""What the registries behind the edges hold, for ``GET /v1/images``.

Edges report the registry they load layers from (``EdgeHealth.registry``). The
control plane lists each one's DSec layers (``/v2/_catalog``, then each
repository's tags; the ``sha256-<hex>`` alias tags a push adds are left out) so
``GET /v1/images`` shows what can be run, held by an edge or not. A create does
not wait for this: an edge resolves a name in the same registry itself
(docs/IMAGES.md, "Registry layers on an edge"). Anonymous reads only; a registry
that wants credentials is listed with its error. Cached for ``ttl_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from dsec.images.errors import RegistryError
from dsec.images.registry import RegistryClient

log = logging.getLogger("dsec.control.catalog")

MAX_REPOS = 500
"""Repositories listed per registry at most (a shared registry may hold many unrelated ones)."""


@dataclass
class Listing:
    at: float
    refs: dict[str, str] = field(default_factory=dict)
    """``name:tag`` -> ``<registry>/<repo>``."""
    error: str = ""


class RegistryCatalog:
    def __init__(self, *, ttl_s: float = 30.0, timeout_s: float = 5.0) -> None:
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._cache: dict[str, Listing] = {}
        self._lock = asyncio.Lock()

    async def listing(self, url: str) -> Listing:
        async with self._lock:
            got = self._cache.get(url)
            if got is None or time.monotonic() - got.at > self.ttl_s:
                got = await asyncio.to_thread(self._list, url)
                self._cache[url] = got
            return got

    def _list(self, url: str) -> Listing:
        out = Listing(at=time.monotonic())
        try:
            with RegistryClient(url, timeout=self.timeout_s) as client:
                for repo in client.list_repositories(MAX_REPOS):
                    name = repo.rsplit("/", 1)[-1]
                    for tag in client.list_tags(repo):
                        if not tag.startswith("sha256-"):
                            out.refs.setdefault(f"{name}:{tag}", f"{url}/{repo}")
        except RegistryError as exc:
            out.error = str(exc)
            log.info("registry %s not listed: %s", url, exc)
        return out


__all__ = ["Listing", "RegistryCatalog"]
