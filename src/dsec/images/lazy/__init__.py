"""Lazily loaded layers: registry layers served by one FUSE process per node.

A layer in an OCI registry (the DSec layer format: the EROFS file as one blob, a
chunk table in its config) is exposed as ``<mountpoint>/<hex>.erofs`` without
being downloaded; EROFS is mounted from that file exactly as from a local one.
Chunks are fetched by HTTP Range on first read, verified against the chunk table,
and kept in a node-local content-addressed cache. See docs/IMAGES.md, "Lazy layers".

- :class:`LazyLayers` — the edge's handle: start/adopt the process, attach, detach,
  stats, close, reconcile.
- :class:`RemoteLayer` — where a layer is and its chunk table (pure data).
- :class:`RangeFetcher` — the door to the registry (plug a registry client in).

Importing this package does not import pyfuse3 or trio: only the FUSE process does.
"""

from __future__ import annotations

from .errors import ChunkCorrupt, LayerBusy, LayerUnavailable, LazyError, ServiceDown
from .fetch import FetchError, RangeFetcher
from .manager import LazyLayers, ReconcileReport
from .model import DEFAULT_CHUNK_SIZE, RemoteLayer

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "ChunkCorrupt",
    "FetchError",
    "LayerBusy",
    "LayerUnavailable",
    "LazyError",
    "LazyLayers",
    "RangeFetcher",
    "ReconcileReport",
    "RemoteLayer",
    "ServiceDown",
]
