"""OCI distribution registries: DSec's layer format in them, references, and the HTTP client.

Owns three things, nothing more:

* **The DSec layer format** in a registry. A layer is an OCI image manifest
  (:data:`OCI_MANIFEST`) whose ``artifactType`` is :data:`DSEC_LAYER_ARTIFACT`::

      {"schemaVersion": 2,
       "mediaType": "application/vnd.oci.image.manifest.v1+json",
       "artifactType": "application/vnd.dsec.layer.v1",
       "config": {"mediaType": "application/vnd.dsec.layer.config.v1+json", "digest": ..., "size": ...},
       "layers": [{"mediaType": "application/vnd.dsec.layer.erofs.v1",
                   "digest": "<layer digest>", "size": <EROFS file size>}],
       "annotations": {"org.opencontainers.image.title": "NAME:TAG"}}

  The config blob is :class:`DsecLayerConfig` (kind, name, tag, lineage and a
  chunk table: the sha256 of every :data:`CHUNK_SIZE` slice of the EROFS file).
  The first layer blob *is* the EROFS file, so a chunk is an HTTP Range of it and
  can be verified on its own (:meth:`DsecLayerConfig.verify_chunk`). A push also
  adds the layer's *lazy form* (:class:`LazyForm`, in the config's ``lazy``): two
  more blobs, a metadata-only EROFS image (:data:`DSEC_LAYER_META`) and its data
  device (:data:`DSEC_LAYER_DATA`), each with its own chunk table, so an edge can
  fetch all metadata in one small blob and file data only where it is read.
* **References**: ``[http[s]://]HOST[:PORT]/REPO[:TAG|@sha256:HEX]``
  (:func:`parse_registry_ref`). Without a scheme, loopback hosts are spoken to
  over plain HTTP and every other host over HTTPS.
* **:class:`RegistryClient`**, a blocking httpx client for the distribution API
  (ping, blob HEAD/GET with Range, monolithic and chunked upload, manifest
  PUT/GET by tag or digest) with anonymous, basic and bearer-token auth (tokens
  cached per scope). Every failure is a typed :class:`RegistryError`.

Never touches the layer store or the filesystem beyond a file it is told to
upload: pushing, pulling and importing are :mod:`.transfer` and
:mod:`.oci_import`. Blocking: async code calls it from a thread.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import ipaddress
import itertools
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dsec.errors import InvalidSpec

from .errors import (
    DigestMismatch,
    RegistryAuthError,
    RegistryError,
    RegistryNotFound,
    RegistryUnreachable,
    UnsupportedManifest,
)
from .layer import DIGEST_PREFIX, LayerKind, check_digest, is_digest

# -- media types ---------------------------------------------------------------------

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
ACCEPT = ", ".join((OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST))
"""What :meth:`RegistryClient.get_manifest` accepts; anything else is refused."""

DSEC_LAYER_ARTIFACT = "application/vnd.dsec.layer.v1"
"""``artifactType`` of a DSec layer's manifest."""
DSEC_LAYER_CONFIG = "application/vnd.dsec.layer.config.v1+json"
"""Media type of the config blob: :class:`DsecLayerConfig` as JSON."""
DSEC_LAYER_EROFS = "application/vnd.dsec.layer.erofs.v1"
"""Media type of the first layer blob: the EROFS file itself."""
DSEC_LAYER_META = "application/vnd.dsec.layer.erofs-meta.v1"
"""Media type of the lazy form's metadata image (:class:`LazyForm`)."""
DSEC_LAYER_DATA = "application/vnd.dsec.layer.erofs-data.v1"
"""Media type of the lazy form's data device (:class:`LazyForm`)."""
LAZY_CHUNK_SIZE = 64 << 10
"""Bytes per chunk of the lazy form's tables: a read of a small file fetches at most this
much beyond it (the kernel reads a FUSE file in windows of about twice this anyway)."""
LAZY_FORMAT = "erofs-blobdev-v1"
TITLE_ANNOTATION = "org.opencontainers.image.title"
CHUNK_SIZE = 1 << 20
"""Bytes per chunk of the chunk table (1 MiB); the last chunk may be shorter."""

MAX_MANIFEST_BYTES = 4 << 20
"""distribution's own limit on a manifest."""
MAX_CONFIG_BYTES = 64 << 20
"""A DSec config holds ~75 bytes per MiB of layer: 64 MiB covers layers of ~800 GiB."""
UPLOAD_CHUNK = 32 << 20
"""Bytes per PATCH of a chunked blob upload (blobs no larger go in one PUT)."""

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_REPO = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


def sha256_digest(data: bytes) -> str:
    return DIGEST_PREFIX + hashlib.sha256(data).hexdigest()


def layer_alias_tag(digest: str) -> str:
    """The tag a pushed layer is also stored under, so a child's pull can find it by its
    layer digest: ``sha256-<hex>`` (cosign's convention for digest-named tags)."""
    return "sha256-" + check_digest(digest)[len(DIGEST_PREFIX) :]


# -- the DSec layer config -------------------------------------------------------------


class BlobTable(BaseModel):
    """One blob and its chunk table. The file it stands for is cut in ``chunk_size`` pieces
    (``size`` bytes in all); with ``encoding`` "zstd" each piece is compressed on its own and
    the blob is their concatenation, piece ``i`` at ``[offsets[i], offsets[i+1])``; without,
    the blob is the file. ``chunks[i]`` is the sha256 of piece ``i`` as stored (so a fetched
    piece is checked before it is decompressed); ``digest`` is the blob's."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    digest: str
    size: int = Field(gt=0)
    chunk_size: int = Field(default=LAZY_CHUNK_SIZE, ge=4096, le=64 << 20)
    chunks: tuple[str, ...]
    encoding: Literal["", "zstd"] = ""
    offsets: tuple[int, ...] = ()

    @property
    def blob_size(self) -> int:
        """Bytes of the blob in the registry."""
        return self.offsets[-1] if self.encoding else self.size

    @field_validator("digest")
    @classmethod
    def _digest(cls, v: str) -> str:
        return check_digest(v)

    @field_validator("chunks")
    @classmethod
    def _digests(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_digest(d) for d in v)

    @model_validator(mode="after")
    def _count(self) -> BlobTable:
        want = math.ceil(self.size / self.chunk_size)
        if len(self.chunks) != want:
            raise ValueError(f"chunk table has {len(self.chunks)} entries; a {self.size}-byte blob in "
                             f"{self.chunk_size}-byte chunks has {want}")  # fmt: skip
        if self.encoding and (len(self.offsets) != want + 1 or self.offsets[0] != 0
                              or any(b <= a for a, b in itertools.pairwise(self.offsets))):
            raise ValueError(f"an encoded blob needs {want + 1} increasing offsets from 0")
        return self

    @classmethod
    def encode_file(cls, path: Path, dest: Path, *, chunk_size: int = LAZY_CHUNK_SIZE, level: int = 6) -> BlobTable:
        """Write ``path`` to ``dest`` as zstd-compressed chunks, one frame per chunk, and
        return the table of ``dest``."""
        import zstandard

        comp = zstandard.ZstdCompressor(level=level)
        whole = hashlib.sha256()
        chunks: list[str] = []
        offsets = [0]
        size = 0
        with open(path, "rb") as f, open(dest, "wb") as out:
            while buf := f.read(chunk_size):
                piece = comp.compress(buf)
                out.write(piece)
                whole.update(piece)
                chunks.append(sha256_digest(piece))
                offsets.append(offsets[-1] + len(piece))
                size += len(buf)
        return cls(digest=DIGEST_PREFIX + whole.hexdigest(), size=size, chunk_size=chunk_size, chunks=tuple(chunks),
                   encoding="zstd", offsets=tuple(offsets))  # fmt: skip

    @classmethod
    def of_file(cls, path: Path, *, chunk_size: int = LAZY_CHUNK_SIZE) -> BlobTable:
        whole = hashlib.sha256()
        chunks: list[str] = []
        size = 0
        with open(path, "rb") as f:
            while buf := f.read(chunk_size):
                whole.update(buf)
                chunks.append(sha256_digest(buf))
                size += len(buf)
        return cls(digest=DIGEST_PREFIX + whole.hexdigest(), size=size, chunk_size=chunk_size, chunks=tuple(chunks))


class LazyForm(BaseModel):
    """The same tree as the layer's EROFS file, laid out for lazy loading: ``meta`` is an
    EROFS image that holds every inode, directory and chunk index and no file data
    (``mkfs.erofs --blobdev --chunksize 4096``), ``data`` its extra device with the file
    contents. An edge fetches ``meta`` whole when it attaches the layer (``ls -R`` and
    ``stat`` need nothing else) and ``data`` chunk by chunk on first read; EROFS mounts
    ``meta`` with ``device=<data>``. Built at push time (docs/IMAGES.md)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    format: str = LAZY_FORMAT
    meta: BlobTable
    data: BlobTable
    prefetch: tuple[tuple[int, int], ...] = ()
    """Chunks of ``data`` an edge fetches ahead when it attaches the layer, as ``(first,
    count)`` runs: what ``profile`` read when the push ran it (:mod:`.lazyprofile`)."""
    profile: str = ""
    """The start-up command whose reads ``prefetch`` holds ("" without a profile)."""
    extents: str = Field(default="", repr=False)
    """Where each file's data lies in ``data`` (``dsec.images.lazy.extents.pack``): an edge's
    miss then fetches the rest of its file at once, from the first read on ("": the edge works
    them out from ``meta``, which takes a while for a large image)."""

    @model_validator(mode="after")
    def _prefetch(self) -> LazyForm:
        n = len(self.data.chunks)
        for first, count in self.prefetch:
            if first < 0 or count <= 0 or first + count > n:
                raise ValueError(f"prefetch run ({first}, {count}) is outside the data device's {n} chunks")
        return self

    @property
    def prefetch_bytes(self) -> int:
        """Bytes of the prefetch runs as stored (what an edge fetches ahead)."""
        wire = self.data.offsets
        if not wire:
            return sum(min(c * self.data.chunk_size, self.data.size - f * self.data.chunk_size)
                       for f, c in self.prefetch)  # fmt: skip
        return sum(wire[f + c] - wire[f] for f, c in self.prefetch)


class DsecLayerConfig(BaseModel):
    """The config blob of a DSec layer in a registry: what the layer is, and its chunk table.

    ``chunks[i]`` is ``sha256:<hex>`` of bytes ``[i * chunk_size, min((i + 1) * chunk_size,
    size))`` of the EROFS file whose own digest is ``digest``. Unknown keys are ignored
    (a newer writer may add some); the ones here are checked: digests well formed, and
    exactly ``ceil(size / chunk_size)`` chunks.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: LayerKind
    name: str
    tag: str
    parents: tuple[str, ...] = ()
    """Digests of the layers this one was built on, nearest first (DSec layer digests)."""
    size: int = Field(gt=0)
    """Bytes of the EROFS file."""
    digest: str
    """``sha256:<hex>`` of the EROFS file: the layer's digest, and its blob's."""
    chunk_size: int = Field(default=CHUNK_SIZE, ge=4096, le=64 << 20)
    chunks: tuple[str, ...]
    lazy: LazyForm | None = None
    """The layer's lazy form (two more blobs of the manifest), when the push made one."""

    @field_validator("digest")
    @classmethod
    def _digest(cls, v: str) -> str:
        return check_digest(v)

    @field_validator("parents", "chunks")
    @classmethod
    def _digests(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_digest(d) for d in v)

    @model_validator(mode="after")
    def _chunk_count(self) -> DsecLayerConfig:
        want = math.ceil(self.size / self.chunk_size)
        if len(self.chunks) != want:
            raise ValueError(
                f"chunk table has {len(self.chunks)} entries; a {self.size}-byte layer in "
                f"{self.chunk_size}-byte chunks has {want}"
            )
        return self

    @property
    def chunk_count(self) -> int:
        return len(self.chunks)

    def chunk_range(self, i: int) -> tuple[int, int]:
        """``(start, end)`` byte offsets of chunk ``i`` in the EROFS file, ``end`` exclusive
        (an HTTP ``Range: bytes=start-(end-1)``). IndexError outside the table."""
        if not 0 <= i < len(self.chunks):
            raise IndexError(f"chunk {i} is outside this layer's {len(self.chunks)} chunks")
        start = i * self.chunk_size
        return start, min(start + self.chunk_size, self.size)

    def chunk_of(self, offset: int) -> int:
        """The index of the chunk that holds byte ``offset``."""
        if not 0 <= offset < self.size:
            raise IndexError(f"offset {offset} is outside this {self.size}-byte layer")
        return offset // self.chunk_size

    def verify_chunk(self, i: int, data: bytes) -> bool:
        """True when ``data`` is exactly chunk ``i`` (length and sha256)."""
        start, end = self.chunk_range(i)
        return len(data) == end - start and sha256_digest(data) == self.chunks[i]

    def to_json(self) -> bytes:
        """The config blob's bytes (compact JSON, fields in declaration order)."""
        return self.model_dump_json().encode()

    @classmethod
    def parse(cls, raw: bytes, *, where: str = "") -> DsecLayerConfig:
        """Parse a config blob; :class:`UnsupportedManifest` naming the first problem."""
        try:
            return cls.model_validate_json(raw)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(x) for x in first.get("loc", ())) or "(config)"
            raise UnsupportedManifest(
                f"{where or 'the registry'}: the DSec layer config is invalid at {loc}: "
                f"{first['msg']}; push the layer again with `dsec image push`",
                media_type=DSEC_LAYER_CONFIG,
            ) from None

    @classmethod
    def of_file(
        cls,
        path: Path,
        *,
        kind: LayerKind | str,
        name: str,
        tag: str,
        parents: tuple[str, ...] = (),
        chunk_size: int = CHUNK_SIZE,
    ) -> DsecLayerConfig:
        """Read ``path`` once: its digest, size and chunk table."""
        whole = hashlib.sha256()
        chunks: list[str] = []
        size = 0
        with open(path, "rb") as f:
            while True:
                buf = f.read(chunk_size)
                if not buf:
                    break
                whole.update(buf)
                chunks.append(sha256_digest(buf))
                size += len(buf)
        return cls(kind=LayerKind(kind), name=name, tag=tag, parents=parents, size=size,
                   digest=DIGEST_PREFIX + whole.hexdigest(), chunk_size=chunk_size,
                   chunks=tuple(chunks))  # fmt: skip


# -- descriptors and manifests -----------------------------------------------------------


@dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor: a blob or manifest by media type, digest and size."""

    media_type: str
    digest: str
    size: int
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """The descriptor's other keys (``platform``, ``annotations``, ``urls``...)."""

    def to_json(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size, **self.extra}

    @classmethod
    def parse(cls, d: Any, *, where: str) -> Descriptor:
        if not isinstance(d, dict):
            raise UnsupportedManifest(f"{where}: a descriptor is not a JSON object", media_type="")
        digest, size = d.get("digest"), d.get("size")
        if not isinstance(digest, str) or not is_digest(digest):
            raise UnsupportedManifest(
                f"{where}: descriptor digest {digest!r} is not sha256:<64 hex> (other digest "
                "algorithms are not supported)", media_type=str(d.get("mediaType", "")))  # fmt: skip
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise UnsupportedManifest(f"{where}: descriptor {digest} has no valid size",
                                      media_type=str(d.get("mediaType", "")))  # fmt: skip
        extra = {k: v for k, v in d.items() if k not in ("mediaType", "digest", "size")}
        return cls(str(d.get("mediaType", "")), digest, size, extra)

    @property
    def platform(self) -> dict[str, Any]:
        p = self.extra.get("platform")
        return p if isinstance(p, dict) else {}


@dataclass(frozen=True)
class Manifest:
    """A manifest or index as fetched: its exact bytes, digest, media type and JSON."""

    media_type: str
    digest: str
    raw: bytes
    doc: dict[str, Any]
    where: str = ""

    @property
    def is_index(self) -> bool:
        return self.media_type in INDEX_TYPES

    @property
    def artifact_type(self) -> str:
        return str(self.doc.get("artifactType") or "")

    @property
    def config(self) -> Descriptor:
        if self.is_index:
            raise UnsupportedManifest(f"{self.where} is an index, which has no config",
                                      media_type=self.media_type)  # fmt: skip
        return Descriptor.parse(self.doc.get("config"), where=self.where)

    @property
    def layers(self) -> list[Descriptor]:
        raw = self.doc.get("layers")
        if self.is_index or not isinstance(raw, list):
            raise UnsupportedManifest(f"{self.where}: the manifest lists no layers",
                                      media_type=self.media_type)  # fmt: skip
        return [Descriptor.parse(d, where=self.where) for d in raw]

    @property
    def manifests(self) -> list[Descriptor]:
        raw = self.doc.get("manifests")
        if not self.is_index or not isinstance(raw, list):
            raise UnsupportedManifest(f"{self.where} is not an index of manifests",
                                      media_type=self.media_type)  # fmt: skip
        return [Descriptor.parse(d, where=self.where) for d in raw]

    @property
    def is_dsec_layer(self) -> bool:
        if self.media_type != OCI_MANIFEST:
            return False
        cfg = self.doc.get("config")
        return self.artifact_type == DSEC_LAYER_ARTIFACT or (
            isinstance(cfg, dict) and cfg.get("mediaType") == DSEC_LAYER_CONFIG
        )


def dsec_layer_manifest(config: Descriptor, blob: Descriptor, *, title: str,
                        lazy: tuple[Descriptor, Descriptor] | None = None) -> bytes:
    """The manifest bytes of a DSec layer (the format in the module docstring): the EROFS
    file, then the lazy form's metadata image and data device if there is one."""
    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": DSEC_LAYER_ARTIFACT,
        "config": config.to_json(),
        "layers": [blob.to_json(), *(d.to_json() for d in lazy or ())],
        "annotations": {TITLE_ANNOTATION: title},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


# -- references -------------------------------------------------------------------------


@dataclass(frozen=True)
class RegistryRef:
    """``base_url`` (scheme://host[:port]), ``repo``, and a ``tag`` or a manifest ``digest``."""

    base_url: str
    repo: str
    tag: str | None = None
    digest: str | None = None

    @property
    def reference(self) -> str:
        """What goes after ``/manifests/``: the digest if given, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        host = self.base_url.split("://", 1)[1]
        return f"{host}/{self.repo}" + (f"@{self.digest}" if self.digest else f":{self.tag or 'latest'}")


def _is_loopback(host: str) -> bool:
    h = host.strip("[]")
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def parse_registry_ref(text: str, *, allow_tag: bool = True, default_tag: str | None = "latest") -> RegistryRef:
    """Parse ``[http[s]://]HOST[:PORT]/REPO[:TAG|@sha256:HEX]``.

    The host is required (there is no default registry). Without a scheme, a
    loopback host (localhost, 127.0.0.0/8, ::1) is reached over http, any other
    over https. ``allow_tag=False`` refuses a tag or digest (a ``--registry`` that
    names a repository only). Raises InvalidSpec naming what is wrong.
    """
    hint = "use [http[s]://]HOST[:PORT]/REPO[:TAG] or HOST[:PORT]/REPO@sha256:<hex>"
    s = text.strip()
    scheme = ""
    for sch in ("http://", "https://"):
        if s.startswith(sch):
            scheme, s = sch[:-3], s[len(sch) :]
    host, slash, rest = s.partition("/")
    if not slash or not host or not rest:
        raise InvalidSpec(f"bad registry reference {text!r}: {hint}", field="ref")
    hostname = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    if not scheme and not ("." in host or ":" in host or hostname == "localhost"):
        raise InvalidSpec(
            f"bad registry reference {text!r}: {host!r} is not a registry host (give HOST:PORT "
            f"or a dotted name; there is no default registry): {hint}", field="ref",
        )  # fmt: skip
    if not scheme:
        scheme = "http" if _is_loopback(hostname) else "https"
    digest = tag = None
    repo = rest
    if "@" in rest:
        repo, _, digest = rest.partition("@")
        if not is_digest(digest):
            raise InvalidSpec(f"bad registry reference {text!r}: after @ give sha256:<64 hex>", field="ref")
    else:
        last = rest.rsplit("/", 1)[-1]
        if ":" in last:
            repo, _, tag = rest.rpartition(":")
            if not _TAG.match(tag):
                raise InvalidSpec(f"bad tag {tag!r} in {text!r}: 1-128 of A-Z a-z 0-9 . _ -", field="ref")
    repo = repo.rstrip("/")
    if not _REPO.match(repo):
        raise InvalidSpec(
            f"bad repository {repo!r} in {text!r}: lowercase path components of a-z 0-9 . _ -",
            field="ref",
        )  # fmt: skip
    if not allow_tag and (tag is not None or digest is not None):
        raise InvalidSpec(f"{text!r}: give the repository only (HOST[:PORT]/REPO), without a tag",
                          field="registry")  # fmt: skip
    if tag is None and digest is None:
        tag = default_tag
    return RegistryRef(f"{scheme}://{host}", repo, tag, digest)


# -- auth ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    """A user name and password (or token) for basic auth and the token server."""

    username: str
    password: str = field(repr=False)


_CHALLENGE_PARAM = re.compile(r'([A-Za-z_]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]+))')


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``WWW-Authenticate: Bearer realm="...",service="..."`` -> ("bearer", {...})."""
    scheme, _, rest = header.strip().partition(" ")
    params = {m.group(1).lower(): (m.group(2) if m.group(2) is not None else m.group(3) or "")
              for m in _CHALLENGE_PARAM.finditer(rest)}  # fmt: skip
    return scheme.lower(), params


@dataclass
class _Token:
    value: str
    expires_at: float


def _pull(repo: str) -> str:
    return f"repository:{repo}:pull"


def _push(repo: str) -> str:
    return f"repository:{repo}:pull,push"


# -- the client -------------------------------------------------------------------------------


class BlobReader:
    """A file-like view of a blob being downloaded: ``read(n)`` hashes as it goes and
    :meth:`verify` checks the whole digest and size at the end."""

    def __init__(self, resp: httpx.Response, digest: str, size: int | None, where: str,
                 on_read: Callable[[int], None] | None = None) -> None:  # fmt: skip
        self._it = resp.iter_bytes(1 << 20)
        self._buf = b""
        self._pos = 0
        self._eof = False
        self.digest = digest
        self.size = size
        self.where = where
        self.sha = hashlib.sha256()
        self.count = 0
        self.on_read = on_read

    def _refill(self) -> bool:
        if self._eof:
            return False
        try:
            self._buf = next(self._it)
        except StopIteration:
            self._eof = True
            return False
        except httpx.HTTPError as e:
            raise RegistryUnreachable(f"{self.where}: the download broke off: {e}", status=0,
                                      registry_code="", url=self.where) from e  # fmt: skip
        self._pos = 0
        return True

    def read(self, n: int = -1) -> bytes:
        parts: list[bytes] = []
        want = n
        while want != 0:
            if self._pos >= len(self._buf) and not self._refill():
                break
            avail = len(self._buf) - self._pos
            take = avail if want < 0 else min(avail, want)
            parts.append(self._buf[self._pos : self._pos + take])
            self._pos += take
            if want > 0:
                want -= take
        out = b"".join(parts)
        self.sha.update(out)
        self.count += len(out)
        if self.size is not None and self.count > self.size:
            raise DigestMismatch(f"{self.where}: the registry sent more than the {self.size} bytes "
                                 f"of {self.digest}", expected=self.digest, got="", status=0)  # fmt: skip
        if out and self.on_read is not None:
            self.on_read(len(out))
        return out

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    def verify(self) -> None:
        """Drain what is left, then DigestMismatch unless the bytes hash to the digest."""
        self.drain()
        got = DIGEST_PREFIX + self.sha.hexdigest()
        if got != self.digest or (self.size is not None and self.count != self.size):
            raise DigestMismatch(
                f"{self.where}: the blob is corrupt: its {self.count} bytes hash to {got}, not "
                f"{self.digest}; nothing of it was kept (the registry's copy is damaged or was "
                "tampered with: push it again)", expected=self.digest, got=got, status=0,
            )  # fmt: skip


class RegistryClient:
    """A blocking client for one registry (``base_url``: ``scheme://host[:port]``).

    Auth is worked out per request: anonymous first; a 401 with a ``Basic`` challenge
    is answered with ``credentials``; one with a ``Bearer`` challenge sends us to the
    token server named in it (with ``credentials``, if any) for a token of the
    challenged scope, which is cached until it expires and reused for later requests
    of the same scope. Thread-safe; close it (or use ``with``) when done.
    """

    def __init__(
        self,
        base_url: str,
        *,
        credentials: Credentials | None = None,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        verify: bool | str = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.credentials = credentials
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            follow_redirects=True,
            transport=transport,
            verify=verify,
            headers={"User-Agent": "dsec-registry-client/1"},
        )
        self._lock = threading.Lock()
        self._tokens: dict[str, _Token] = {}
        self._basic = False

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RegistryClient({self.base_url!r})"

    # -- plumbing ---------------------------------------------------------------------

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _auth_header(self, scope: str) -> str | None:
        with self._lock:
            if self._basic and self.credentials is not None:
                raw = f"{self.credentials.username}:{self.credentials.password}".encode()
                return "Basic " + base64.b64encode(raw).decode()
            now = time.monotonic()
            keys = [scope]
            if scope.endswith(":pull"):  # a push token covers pulls of the same repository
                keys.append(scope + ",push")
            for key in keys:
                tok = self._tokens.get(key)
                if tok is not None and tok.expires_at > now:
                    return "Bearer " + tok.value
        return None

    def _fetch_token(self, params: dict[str, str], scope: str, where: str) -> None:
        realm = params.get("realm")
        if not realm:
            raise RegistryAuthError(f"{where}: the registry asked for a bearer token but named no "
                                    "token server (no realm in WWW-Authenticate)", status=401,
                                    registry_code="", url=where)  # fmt: skip
        query: list[tuple[str, str | int | float | bool | None]] = []
        if params.get("service"):
            query.append(("service", params["service"]))
        for s in (params.get("scope") or scope).split():
            if s:
                query.append(("scope", s))
        auth = None
        if self.credentials is not None:
            auth = httpx.BasicAuth(self.credentials.username, self.credentials.password)
            query.append(("account", self.credentials.username))
        try:
            resp = self._http.get(realm, params=query, auth=auth)
        except httpx.HTTPError as e:
            raise RegistryUnreachable(f"cannot reach the registry's token server {realm}: {e}",
                                      status=0, registry_code="", url=realm) from e  # fmt: skip
        if resp.status_code in (401, 403):
            who = (f"user {self.credentials.username!r} was refused" if self.credentials
                   else "it wants a user name and password")  # fmt: skip
            raise RegistryAuthError(
                f"the token server {realm} gave no token for {scope or 'the registry'}: {who}; "
                "give credentials with --username and DSEC_REGISTRY_PASSWORD (or check them)",
                status=resp.status_code, registry_code=_error_code(resp), url=realm,
            )  # fmt: skip
        if resp.status_code != 200:
            raise RegistryAuthError(f"the token server {realm} answered {resp.status_code}: "
                                    f"{resp.text[:300]}", status=resp.status_code,
                                    registry_code=_error_code(resp), url=realm)  # fmt: skip
        try:
            body = resp.json()
            token = body.get("token") or body.get("access_token")
            expires_in = float(body.get("expires_in") or 60)
        except (ValueError, AttributeError, TypeError):
            token, expires_in = None, 0.0
        if not isinstance(token, str) or not token:
            raise RegistryAuthError(f"the token server {realm} sent no token", status=resp.status_code,
                                    registry_code="", url=realm)  # fmt: skip
        with self._lock:
            # A little early, so a token never expires on the way.
            self._tokens[scope] = _Token(token, time.monotonic() + max(1.0, expires_in - 5.0))

    def _challenge(self, resp: httpx.Response, scope: str, sent: str | None, where: str) -> None:
        scheme, params = parse_challenge(resp.headers.get("www-authenticate", ""))
        if scheme == "basic":
            if self.credentials is None:
                raise RegistryAuthError(
                    f"{where}: the registry wants a user name and password: give --username and "
                    "set DSEC_REGISTRY_PASSWORD", status=401, registry_code=_error_code(resp), url=where,
                )  # fmt: skip
            if sent is not None and sent.startswith("Basic "):
                raise RegistryAuthError(
                    f"{where}: the registry refused user {self.credentials.username!r}: check the "
                    "user name and password", status=401, registry_code=_error_code(resp), url=where,
                )  # fmt: skip
            with self._lock:
                self._basic = True
            return
        if scheme == "bearer":
            if sent is not None and sent.startswith("Bearer "):
                # A cached token that expired early, or one without enough scope: once more.
                with self._lock:
                    self._tokens.pop(scope, None)
            self._fetch_token(params, scope, where)
            return
        raise RegistryAuthError(f"{where}: the registry wants {scheme or 'an unknown'} auth, which "
                                "DSec does not speak (basic and bearer tokens only)", status=401,
                                registry_code=_error_code(resp), url=where)  # fmt: skip

    def _send(
        self,
        method: str,
        url: str,
        *,
        scope: str,
        headers: dict[str, str] | None = None,
        content: bytes | None = None,
        stream: bool = False,
    ) -> httpx.Response:
        """One request with the auth dance (at most two challenges); network failures are
        RegistryUnreachable. The caller checks the status."""
        for attempt in range(3):
            h = dict(headers or {})
            auth = self._auth_header(scope)
            if auth is not None:
                h["Authorization"] = auth
            req = self._http.build_request(method, url, headers=h, content=content)
            try:
                resp = self._http.send(req, stream=stream)
            except httpx.HTTPError as e:
                raise RegistryUnreachable(
                    f"cannot reach the registry at {self.base_url} ({method} {url}): {e or type(e).__name__}; "
                    "check the address and that the registry runs", status=0, registry_code="", url=url,
                ) from e  # fmt: skip
            if resp.status_code != 401 or attempt == 2:
                return resp
            resp.read()
            resp.close()
            self._challenge(resp, scope, auth, url)
        raise AssertionError("unreachable")  # pragma: no cover

    def _fail(self, resp: httpx.Response, what: str, *, hint: str = "") -> RegistryError:
        """The typed error for a failed answer to ``what``."""
        with contextlib.suppress(httpx.HTTPError):
            resp.read()
        code, msg = _error_body(resp)
        detail = f": {code} {msg}".rstrip() if code or msg else ""
        where = f"{what} ({resp.request.method} {resp.request.url}) -> {resp.status_code}{detail}"
        fields: dict[str, Any] = {"status": resp.status_code, "registry_code": code, "url": str(resp.request.url)}
        if resp.status_code in (401, 403):
            return RegistryAuthError(
                f"{where}; the credentials do not allow this (check --username / DSEC_REGISTRY_PASSWORD "
                "and the account's access to the repository)", **fields)  # fmt: skip
        if resp.status_code == 404:
            return RegistryNotFound(f"{where}{'; ' + hint if hint else ''}", **fields)
        if resp.status_code == 405:
            return RegistryError(f"{where}; the registry does not allow this operation (read-only, "
                                 "or deletes disabled)", **fields)  # fmt: skip
        return RegistryError(f"{where}{'; ' + hint if hint else ''}", **fields)

    # -- API ---------------------------------------------------------------------------

    def ping(self) -> None:
        """GET /v2/ (authenticating if asked): RegistryError unless the registry answers 200."""
        resp = self._send("GET", self._url("/v2/"), scope="")
        if resp.status_code != 200:
            raise self._fail(resp, "ping", hint="is this an OCI distribution (v2) registry?")

    def blob_size(self, repo: str, digest: str) -> int | None:
        """HEAD the blob: its size, or None when the repository does not have it."""
        resp = self._send("HEAD", self._url(f"/v2/{repo}/blobs/{digest}"), scope=_pull(repo))
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise self._fail(resp, f"checking blob {digest} in {repo}")
        with contextlib.suppress(ValueError):
            return int(resp.headers.get("content-length", "-1"))
        return -1  # pragma: no cover - a registry that sends no length

    def get_blob(self, repo: str, digest: str, *, max_bytes: int = MAX_CONFIG_BYTES) -> bytes:
        """The whole blob, verified against its digest (for small blobs: configs)."""
        with self.open_blob(repo, digest) as r:
            data = r.read(max_bytes + 1)
            if len(data) > max_bytes:
                raise RegistryError(f"{repo}@{digest} is larger than {max_bytes} bytes, too large for "
                                    "metadata", status=0, registry_code="", url=r.where)  # fmt: skip
            r.verify()
        return data

    def get_blob_range(self, repo: str, digest: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a blob by HTTP Range (not verified: the caller checks
        them against a chunk table). RegistryError if the registry ignores the Range."""
        if not 0 <= start < end:
            raise ValueError(f"bad byte range [{start}, {end})")
        url = self._url(f"/v2/{repo}/blobs/{digest}")
        resp = self._send("GET", url, scope=_pull(repo), headers={"Range": f"bytes={start}-{end - 1}"})
        if resp.status_code != 206:
            if resp.status_code == 200:
                raise RegistryError(f"{url}: the registry ignored the Range header (answered 200, not "
                                    "206); lazy loading needs a registry that serves ranges",
                                    status=200, registry_code="", url=url)  # fmt: skip
            raise self._fail(resp, f"reading bytes {start}-{end - 1} of blob {digest} in {repo}")
        data = resp.content
        if len(data) != end - start:
            raise DigestMismatch(f"{url}: asked for {end - start} bytes at {start}, got {len(data)}",
                                 expected=digest, got="", status=206)  # fmt: skip
        return data

    @contextlib.contextmanager
    def open_blob(self, repo: str, digest: str, *, size: int | None = None,
                  on_read: Callable[[int], None] | None = None) -> Iterator[BlobReader]:  # fmt: skip
        """Stream a blob: a :class:`BlobReader`; call its ``verify()`` after reading."""
        url = self._url(f"/v2/{repo}/blobs/{digest}")
        resp = self._send("GET", url, scope=_pull(repo), stream=True)
        try:
            if resp.status_code != 200:
                raise self._fail(resp, f"fetching blob {digest} from {repo}",
                                 hint="the registry does not have it (was the push complete?)")  # fmt: skip
            yield BlobReader(resp, digest, size, f"{self.base_url}/{repo}@{digest}", on_read)
        finally:
            resp.close()

    def _start_upload(self, repo: str) -> str:
        resp = self._send("POST", self._url(f"/v2/{repo}/blobs/uploads/"), scope=_push(repo),
                          headers={"Content-Length": "0"})  # fmt: skip
        if resp.status_code != 202 or "location" not in resp.headers:
            raise self._fail(resp, f"starting an upload to {repo}")
        return self._location(resp)

    def _location(self, resp: httpx.Response) -> str:
        return str(resp.request.url.join(resp.headers["location"]))

    def _finish_upload(self, repo: str, location: str, digest: str, body: bytes) -> None:
        url = str(httpx.URL(location).copy_merge_params({"digest": digest}))
        resp = self._send("PUT", url, scope=_push(repo), content=body,
                          headers={"Content-Type": "application/octet-stream"})  # fmt: skip
        if resp.status_code not in (201, 204):
            raise self._fail(resp, f"finishing the upload of {digest} to {repo}")
        got = resp.headers.get("docker-content-digest")
        if got and got != digest:
            raise DigestMismatch(f"the registry stored {digest} as {got}", expected=digest, got=got,
                                 status=resp.status_code)  # fmt: skip

    def push_blob(self, repo: str, data: bytes, *, media_type: str = "application/octet-stream") -> Descriptor:
        """Upload ``data`` in one PUT (skipped when the registry has it already)."""
        digest = sha256_digest(data)
        if self.blob_size(repo, digest) is None:
            self._finish_upload(repo, self._start_upload(repo), digest, data)
        return Descriptor(media_type, digest, len(data))

    def push_blob_file(
        self,
        repo: str,
        path: Path,
        *,
        digest: str,
        media_type: str = "application/octet-stream",
        chunk: int = UPLOAD_CHUNK,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> tuple[Descriptor, bool]:
        """Upload a file whose sha256 is ``digest``, in PATCHes of ``chunk`` bytes.

        Returns ``(descriptor, uploaded)``; ``uploaded`` is False when a HEAD showed the
        registry has the blob already (nothing is sent). ``on_progress(done, total)``."""
        size = path.stat().st_size
        have = self.blob_size(repo, digest)
        if have is not None:
            if on_progress is not None:
                on_progress(size, size)
            return Descriptor(media_type, digest, size), False
        location = self._start_upload(repo)
        done = 0
        with open(path, "rb") as f:
            if size <= chunk:
                self._finish_upload(repo, location, digest, f.read())
                done = size
            else:
                while True:
                    buf = f.read(chunk)
                    if not buf:
                        break
                    location = self._patch(repo, location, buf, done)
                    done += len(buf)
                    if on_progress is not None:
                        on_progress(done, size)
                self._finish_upload(repo, location, digest, b"")
        if done != size:
            raise RegistryError(f"{path} changed size while it was uploaded ({size} -> {done} bytes)",
                                status=0, registry_code="", url=location)  # fmt: skip
        if on_progress is not None:
            on_progress(size, size)
        return Descriptor(media_type, digest, size), True

    def _patch(self, repo: str, location: str, buf: bytes, offset: int) -> str:
        resp = self._send("PATCH", location, scope=_push(repo), content=buf, headers={
            "Content-Type": "application/octet-stream",
            "Content-Range": f"{offset}-{offset + len(buf) - 1}",
        })  # fmt: skip
        if resp.status_code != 202 or "location" not in resp.headers:
            raise self._fail(resp, f"uploading bytes {offset}-{offset + len(buf) - 1} to {repo}")
        return self._location(resp)

    def put_manifest(self, repo: str, reference: str, raw: bytes, media_type: str) -> str:
        """Store a manifest under a tag (or its digest); returns its digest."""
        digest = sha256_digest(raw)
        resp = self._send("PUT", self._url(f"/v2/{repo}/manifests/{reference}"), scope=_push(repo),
                          content=raw, headers={"Content-Type": media_type})  # fmt: skip
        if resp.status_code not in (200, 201, 202):
            raise self._fail(resp, f"storing the manifest {repo}:{reference}",
                             hint="a blob it references is missing")  # fmt: skip
        got = resp.headers.get("docker-content-digest")
        if got and got != digest:
            raise DigestMismatch(f"the registry stored manifest {digest} as {got}", expected=digest,
                                 got=got, status=resp.status_code)  # fmt: skip
        return digest

    def get_manifest(self, repo: str, reference: str) -> Manifest:
        """A manifest or index by tag or digest, verified when the digest is known.

        Accepts OCI and Docker v2 schema 2 manifests and OCI indexes / Docker manifest
        lists; anything else is :class:`UnsupportedManifest`."""
        where = f"{self.base_url}/{repo}" + (f"@{reference}" if reference.startswith(DIGEST_PREFIX)
                                             else f":{reference}")  # fmt: skip
        resp = self._send("GET", self._url(f"/v2/{repo}/manifests/{reference}"), scope=_pull(repo),
                          headers={"Accept": ACCEPT}, stream=True)  # fmt: skip
        try:
            if resp.status_code != 200:
                raise self._fail(resp, f"fetching {where}",
                                 hint="no such repository or tag (see the registry's /v2/<repo>/tags/list)")
            raw = b""
            for piece in resp.iter_bytes():
                raw += piece
                if len(raw) > MAX_MANIFEST_BYTES:
                    raise UnsupportedManifest(f"{where}: the manifest is larger than {MAX_MANIFEST_BYTES} "
                                              "bytes", media_type="")  # fmt: skip
        except httpx.HTTPError as e:
            raise RegistryUnreachable(f"{where}: the download broke off: {e}", status=0,
                                      registry_code="", url=where) from e  # fmt: skip
        finally:
            resp.close()
        digest = sha256_digest(raw)
        if reference.startswith(DIGEST_PREFIX) and digest != reference:
            raise DigestMismatch(f"{where}: the registry sent a manifest whose digest is {digest}",
                                 expected=reference, got=digest, status=200)  # fmt: skip
        header = resp.headers.get("docker-content-digest")
        if header and is_digest(header) and header != digest:
            raise DigestMismatch(f"{where}: the manifest hashes to {digest}, but the registry says {header}",
                                 expected=header, got=digest, status=200)  # fmt: skip
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise UnsupportedManifest(f"{where}: the manifest is not JSON ({e})", media_type="") from None
        if not isinstance(doc, dict):
            raise UnsupportedManifest(f"{where}: the manifest is not a JSON object", media_type="")
        ctype = resp.headers.get("content-type", "").split(";")[0].strip()
        media = str(doc.get("mediaType") or "") or ctype
        if not media and "manifests" in doc:
            media = OCI_INDEX
        elif not media and "layers" in doc:
            media = OCI_MANIFEST
        if media not in MANIFEST_TYPES + INDEX_TYPES:
            hint = (" (Docker schema 1, retired in 2019: re-push the image with a current tool)"
                    if "v1+" in media or doc.get("schemaVersion") == 1 else "")  # fmt: skip
            raise UnsupportedManifest(
                f"{where} has media type {media or '(none)'!r}{hint}; DSec reads OCI and Docker v2 "
                "schema 2 manifests, OCI indexes and Docker manifest lists", media_type=media,
            )  # fmt: skip
        if doc.get("schemaVersion") != 2:
            raise UnsupportedManifest(f"{where}: schemaVersion {doc.get('schemaVersion')!r}, expected 2",
                                      media_type=media)  # fmt: skip
        return Manifest(media, digest, raw, doc, where)

    def auth_headers(self, repo: str) -> dict[str, str]:
        """The headers that let a plain HTTP client read ``repo``'s blobs now (the lazy
        loader's Range requests): ``{"Authorization": ...}`` after the auth dance, ``{}``
        for an anonymous registry. A bearer token expires (``expires_in``): ask again."""
        scope = _pull(repo)
        header = self._auth_header(scope)
        if header is None:
            resp = self._send("GET", self._url(f"/v2/{repo}/tags/list"), scope=scope)
            if resp.status_code in (401, 403):
                raise self._fail(resp, f"reading {repo}")
            header = self._auth_header(scope)
        return {"Authorization": header} if header is not None else {}

    def list_repositories(self, limit: int = 1000) -> list[str]:
        """The registry's repositories (``/v2/_catalog``), at most ``limit``."""
        resp = self._send("GET", self._url(f"/v2/_catalog?n={limit}"), scope="registry:catalog:*")
        if resp.status_code != 200:
            raise self._fail(resp, "listing the registry's repositories")
        repos = resp.json().get("repositories") or []
        return [str(r) for r in repos][:limit]

    def list_tags(self, repo: str) -> list[str]:
        resp = self._send("GET", self._url(f"/v2/{repo}/tags/list"), scope=_pull(repo))
        if resp.status_code != 200:
            raise self._fail(resp, f"listing the tags of {repo}")
        tags = resp.json().get("tags") or []
        return [str(t) for t in tags]


def _error_body(resp: httpx.Response) -> tuple[str, str]:
    """(code, message) of the first entry of a distribution error body, or ("", text)."""
    try:
        body = json.loads(resp.content or b"{}")
    except (ValueError, httpx.ResponseNotRead):
        return "", ""
    errors = body.get("errors") if isinstance(body, dict) else None
    if isinstance(errors, list) and errors and isinstance(errors[0], dict):
        return str(errors[0].get("code") or ""), str(errors[0].get("message") or "")[:300]
    return "", ""


def _error_code(resp: httpx.Response) -> str:
    return _error_body(resp)[0]


def client_for(ref: RegistryRef, *, credentials: Credentials | None = None, timeout: float = 60.0) -> RegistryClient:
    return RegistryClient(ref.base_url, credentials=credentials, timeout=timeout)


__all__ = [
    "ACCEPT",
    "CHUNK_SIZE",
    "DOCKER_LIST",
    "DOCKER_MANIFEST",
    "DSEC_LAYER_ARTIFACT",
    "DSEC_LAYER_CONFIG",
    "DSEC_LAYER_DATA",
    "DSEC_LAYER_EROFS",
    "DSEC_LAYER_META",
    "INDEX_TYPES",
    "LAZY_CHUNK_SIZE",
    "LAZY_FORMAT",
    "MANIFEST_TYPES",
    "OCI_INDEX",
    "OCI_MANIFEST",
    "TITLE_ANNOTATION",
    "BlobReader",
    "BlobTable",
    "Credentials",
    "Descriptor",
    "DsecLayerConfig",
    "LazyForm",
    "Manifest",
    "RegistryClient",
    "RegistryRef",
    "client_for",
    "dsec_layer_manifest",
    "layer_alias_tag",
    "parse_challenge",
    "parse_registry_ref",
    "sha256_digest",
]
