"""What a lazily loaded layer is: its registry location and chunk table. Pure data, no I/O.

The chunk table is the one of the shared DSec layer format (docs/IMAGES.md): the
layer's config blob lists ``chunks[i]`` = sha256 of bytes
``[i*chunk_size, min((i+1)*chunk_size, size))`` of the EROFS file, which is itself
the manifest's one layer blob, so chunk ``i`` is one HTTP Range request on that blob.
"""

from __future__ import annotations

import itertools
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dsec.errors import InvalidSpec

DEFAULT_CHUNK_SIZE = 1 << 20
FSNAME = "dsec-lazy"
"""The FUSE mount's source and subtype: how reconcile and leak checks recognise it."""
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 64 << 20
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def _check_digest(v: str) -> str:
    if not _DIGEST.match(v):
        raise ValueError(f"not a sha256 digest: {v!r}")
    return v


class RemoteLayer(BaseModel):
    """One layer in an OCI registry, as the FUSE process needs it to serve the layer.

    ``headers`` go with every Range request (``Authorization``); they are secrets:
    kept out of ``repr`` and written only to the service's root-only state file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    registry: str
    """Base URL, e.g. ``http://127.0.0.1:5000`` (no trailing ``/v2``)."""
    repo: str
    digest: str
    """``sha256:<hex>`` of the whole EROFS file (the layer blob's digest)."""
    size: int = Field(gt=0)
    chunk_size: int = DEFAULT_CHUNK_SIZE
    chunks: tuple[str, ...]
    headers: dict[str, str] = Field(default_factory=dict, repr=False)
    encoding: Literal["", "zstd"] = ""
    """"zstd": each chunk is stored compressed on its own (a lazy form's blobs): ``chunks[i]``
    is the digest of its compressed bytes, which lie at ``[offsets[i], offsets[i+1])`` of the
    blob; ``digest`` is the blob's and ``size`` what the file shows (decompressed)."""
    offsets: tuple[int, ...] = ()
    prefetch: tuple[tuple[int, int], ...] = ()
    """Chunk runs ``(first, count)`` fetched in the background as soon as the layer is
    attached: a lazy form's prefetch profile (the chunks a start-up read when it was pushed)."""
    extents: str = Field(default="", repr=False)
    """A lazy form's data device: its files' extents as the push worked them out
    (:func:`dsec.images.lazy.extents.pack`); "" to work them out from the metadata image."""

    @field_validator("digest")
    @classmethod
    def _digest(cls, v: str) -> str:
        return _check_digest(v)

    @field_validator("chunks")
    @classmethod
    def _chunks(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for d in v:
            _check_digest(d)
        return v

    @field_validator("registry")
    @classmethod
    def _registry(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"registry must be an http(s) URL: {v!r}")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _table(self) -> RemoteLayer:
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size {self.chunk_size} outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
        want = -(-self.size // self.chunk_size)
        if len(self.chunks) != want:
            raise ValueError(
                f"chunk table has {len(self.chunks)} entries; size {self.size} at "
                f"chunk_size {self.chunk_size} needs {want}"
            )
        if self.encoding and (len(self.offsets) != want + 1 or self.offsets[0] != 0
                              or any(b <= a for a, b in itertools.pairwise(self.offsets))):
            raise ValueError(f"an encoded blob needs {want + 1} increasing offsets from 0")
        if not self.encoding and self.offsets:
            raise ValueError("offsets belong to an encoded blob")
        for first, count in self.prefetch:
            if first < 0 or count <= 0 or first + count > want:
                raise ValueError(f"prefetch run ({first}, {count}) is outside the {want} chunks")
        return self

    def prefetch_indexes(self) -> list[int]:
        return [i for first, count in self.prefetch for i in range(first, first + count)]

    @property
    def hex(self) -> str:
        return self.digest.removeprefix("sha256:")

    @property
    def filename(self) -> str:
        """The layer's file name in the FUSE mount: ``<hex>.erofs``."""
        return f"{self.hex}.erofs"

    def chunk_range(self, index: int) -> tuple[int, int]:
        """``(start, end)`` bytes of chunk ``index`` in the file; ``end`` is exclusive."""
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.size)

    def wire_range(self, index: int) -> tuple[int, int]:
        """``(start, end)`` bytes of chunk ``index`` in the registry's blob (a Range request)."""
        if self.encoding:
            return self.offsets[index], self.offsets[index + 1]
        return self.chunk_range(index)

    @classmethod
    def from_config(
        cls, config: dict[str, Any], *, registry: str, repo: str, headers: dict[str, str] | None = None
    ) -> RemoteLayer:
        """Build from a layer's config blob (``application/vnd.dsec.layer.config.v1+json``)."""
        try:
            return cls(
                registry=registry,
                repo=repo,
                digest=config["digest"],
                size=config["size"],
                chunk_size=config.get("chunk_size", DEFAULT_CHUNK_SIZE),
                chunks=tuple(config["chunks"]),
                headers=dict(headers or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidSpec(f"not a DSec layer config: {exc}", field="config") from exc


__all__ = ["DEFAULT_CHUNK_SIZE", "FSNAME", "RemoteLayer"]
