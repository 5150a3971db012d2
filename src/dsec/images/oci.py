"""Reading container images users already have: OCI layouts and ``docker save`` files.

Owns: finding an image's layer blobs, in order, inside an OCI image layout
(a directory or a tarball of one, as written by ``skopeo``, ``buildah``,
``podman save --format oci-archive``, ``docker save`` >= 25) or a classic
``docker save`` tarball (``manifest.json`` + ``<id>/layer.tar``). Applying the
layers is :mod:`dsec.images.unpack`'s job. Never talks to a registry.
"""

from __future__ import annotations

import hashlib
import json
import platform
import posixpath
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from .errors import LayerBuildError

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
REF_ANNOTATIONS = ("io.containerd.image.name", "org.opencontainers.image.ref.name")
_MAX_JSON = 64 << 20


@dataclass(frozen=True)
class LayerBlob:
    """One layer of an image: where its bytes are and what they must hash to."""

    path: str
    """Path inside the layout directory / archive."""
    size: int | None
    digest: str | None
    """``sha256:<hex>`` the blob must have, when the format says so."""
    media_type: str


@dataclass(frozen=True)
class ImageLayers:
    format: Literal["oci", "docker"]
    ref: str | None
    layers: tuple[LayerBlob, ...]


class ImageSource:
    """Read-only access to files of an image layout, in a directory or a tarball."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tar: tarfile.TarFile | None = None
        self._members: dict[str, tarfile.TarInfo] = {}
        if path.is_dir():
            return
        if not path.is_file():
            raise LayerBuildError(
                f"image source {path} does not exist", stage="oci", path=str(path)
            )
        try:
            self._tar = tarfile.open(path, "r:*")  # noqa: SIM115 - open for the source's lifetime
            for m in self._tar.getmembers():
                self._members[posixpath.normpath(m.name.lstrip("/"))] = m
        except (tarfile.TarError, OSError) as e:
            if self._tar is not None:
                self._tar.close()
            raise LayerBuildError(
                f"{path} is not a readable tar archive ({e}); give an OCI layout directory, "
                "an OCI archive or a `docker save` tarball",
                stage="oci",
                path=str(path),
            ) from e

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None

    def __enter__(self) -> ImageSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _member(self, name: str) -> tarfile.TarInfo | None:
        name = posixpath.normpath(name.lstrip("/"))
        for _ in range(16):
            m = self._members.get(name)
            if m is None or (not m.issym() and not m.islnk()):
                return m
            # Old `docker save` de-duplicates layers with symlinks to ../<id>/layer.tar.
            base = posixpath.dirname(name) if m.issym() else ""
            name = posixpath.normpath(posixpath.join(base, m.linkname).lstrip("/"))
        return None

    def exists(self, name: str) -> bool:
        if self._tar is None:
            return self._dir_path(name).is_file()
        m = self._member(name)
        return m is not None and m.isreg()

    def _dir_path(self, name: str) -> Path:
        norm = posixpath.normpath("/" + name).lstrip("/")
        return self.path / norm

    def open(self, name: str) -> IO[bytes]:
        if self._tar is None:
            p = self._dir_path(name)
            try:
                return open(p, "rb")
            except OSError as e:
                raise LayerBuildError(
                    f"{self.path}: cannot read {name} ({e.strerror}); the image layout is incomplete",
                    stage="oci",
                ) from e
        m = self._member(name)
        f = self._tar.extractfile(m) if m is not None else None
        if f is None:
            raise LayerBuildError(
                f"{self.path}: {name} is missing from the archive; the image is incomplete "
                "(save it again, including all layers)",
                stage="oci",
            )
        return f

    def read_json(self, name: str) -> Any:
        with self.open(name) as f:
            raw = f.read(_MAX_JSON + 1)
        if len(raw) > _MAX_JSON:
            raise LayerBuildError(
                f"{self.path}: {name} is too large to be image metadata", stage="oci"
            )
        try:
            return json.loads(raw)
        except ValueError as e:
            raise LayerBuildError(
                f"{self.path}: {name} is not valid JSON ({e})", stage="oci"
            ) from e


def host_arch() -> str:
    m = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386"}.get(m, m)


def find_layers(src: ImageSource, *, ref: str | None = None) -> ImageLayers:
    """Locate the image's layers; ``ref`` picks one image when the file holds several."""
    if src.exists("index.json"):
        return _oci_layers(src, ref)
    if src.exists("manifest.json"):
        return _docker_layers(src, ref)
    raise LayerBuildError(
        f"{src.path} is neither an OCI image layout (no index.json) nor a `docker save` "
        "tarball (no manifest.json); for a plain root filesystem tar use --from-tar",
        stage="oci",
    )


def _blob_path(digest: str) -> str:
    alg, _, hexd = digest.partition(":")
    if not alg or not hexd or "/" in digest or ".." in digest:
        raise LayerBuildError(f"bad blob digest {digest!r} in image metadata", stage="oci")
    return f"blobs/{alg}/{hexd}"


@dataclass(frozen=True)
class _Candidate:
    manifest: dict[str, Any]
    names: tuple[str, ...]
    platform: dict[str, Any] | None


def _walk_index(
    src: ImageSource, index: dict[str, Any], names: tuple[str, ...], depth: int = 0
) -> Iterator[_Candidate]:
    if depth > 4:
        raise LayerBuildError("image indexes are nested too deeply", stage="oci")
    for desc in index.get("manifests") or []:
        annotations = desc.get("annotations") or {}
        own = tuple(str(annotations[k]) for k in REF_ANNOTATIONS if k in annotations)
        media = desc.get("mediaType", "")
        doc = src.read_json(_blob_path(str(desc.get("digest", ""))))
        media = media or doc.get("mediaType", "")
        if media in (OCI_INDEX, DOCKER_LIST) or "manifests" in doc:
            yield from _walk_index(src, doc, names + own, depth + 1)
        else:
            yield _Candidate(doc, names + own, desc.get("platform"))


def _matches(ref: str, names: tuple[str, ...]) -> bool:
    for n in names:
        if ref == n or n.endswith("/" + ref) or (n.endswith(":" + ref) and ":" not in ref):
            return True
        if ":" not in ref and (n == ref + ":latest" or n.endswith("/" + ref + ":latest")):
            return True
    return False


def _oci_layers(src: ImageSource, ref: str | None) -> ImageLayers:
    index = src.read_json("index.json")
    if not isinstance(index, dict):
        raise LayerBuildError(f"{src.path}: index.json is not an OCI image index", stage="oci")
    candidates = list(_walk_index(src, index, ()))
    if not candidates:
        raise LayerBuildError(f"{src.path}: index.json lists no image manifests", stage="oci")
    chosen = [c for c in candidates if _matches(ref, c.names)] if ref is not None else candidates
    # Attestations and other platforms: keep images this machine can run.
    runnable = [
        c
        for c in chosen
        if c.platform is None
        or (
            c.platform.get("os") in (None, "linux")
            and c.platform.get("architecture") in (None, host_arch())
        )
    ]
    if len(runnable) != 1:
        names = sorted({n for c in candidates for n in c.names}) or ["(unnamed)"]
        what = f"matching {ref!r} " if ref is not None else ""
        raise LayerBuildError(
            f"{src.path} holds {len(runnable)} linux/{host_arch()} images {what}"
            f"(found: {', '.join(names)}); choose one with --ref NAME",
            stage="oci",
        )
    cand = runnable[0]
    layers = []
    for desc in cand.manifest.get("layers") or []:
        digest = str(desc.get("digest", ""))
        layers.append(
            LayerBlob(
                path=_blob_path(digest),
                size=int(desc["size"]) if "size" in desc else None,
                digest=digest if digest.startswith("sha256:") else None,
                media_type=str(desc.get("mediaType", "")),
            )
        )
    return ImageLayers("oci", cand.names[0] if cand.names else None, tuple(layers))


def _docker_layers(src: ImageSource, ref: str | None) -> ImageLayers:
    manifest = src.read_json("manifest.json")
    if not isinstance(manifest, list) or not manifest:
        raise LayerBuildError(f"{src.path}: manifest.json lists no images", stage="oci")
    entries = [e for e in manifest if isinstance(e, dict)]
    if ref is not None:
        entries = [e for e in entries if _matches(ref, tuple(e.get("RepoTags") or ()))]
    if len(entries) != 1:
        names = sorted(
            {t for e in manifest if isinstance(e, dict) for t in e.get("RepoTags") or ()}
        )
        what = f"matching {ref!r} " if ref is not None else ""
        raise LayerBuildError(
            f"{src.path} holds {len(entries)} images {what}(found: {', '.join(names) or '(untagged)'}); "
            "choose one with --ref NAME",
            stage="oci",
        )
    entry = entries[0]
    layers = []
    for p in entry.get("Layers") or []:
        p = str(p)
        parts = p.split("/")
        digest = None
        if len(parts) == 3 and parts[0] == "blobs" and parts[1] == "sha256":
            digest = "sha256:" + parts[2]
        layers.append(LayerBlob(path=p, size=None, digest=digest, media_type="application/x-tar"))
    tags = entry.get("RepoTags") or []
    return ImageLayers("docker", str(tags[0]) if tags else None, tuple(layers))


class VerifyingReader:
    """Wraps a blob stream: hashes what is read and reports bytes read."""

    def __init__(self, raw: IO[bytes], on_read: Callable[[int], None] | None = None) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.count = 0
        self.on_read = on_read

    def read(self, n: int = -1) -> bytes:
        buf = self.raw.read(n)
        self.sha.update(buf)
        self.count += len(buf)
        if self.on_read is not None and buf:
            self.on_read(len(buf))
        return buf

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


__all__ = ["ImageLayers", "ImageSource", "LayerBlob", "VerifyingReader", "find_layers", "host_arch"]
