"""Importing an ordinary container image from a registry as a DSec base layer.

Owns: choosing the image for this machine (an OCI index or Docker manifest list
resolves to ``linux/<host arch>``; attestation manifests are skipped), checking
its config and layer media types, and feeding its layers (gzip, zstd or
uncompressed tars), streamed straight from the registry, to the same applier
``dsec image build --from-oci`` uses (:func:`dsec.images.build.build_from_layers`:
whiteouts, opaque directories, safe extraction, digest check of every layer),
then mkfs.erofs. No Docker engine, and no layer is stored whole on disk first.

Never follows ``urls`` of foreign (non-distributable) layers to other hosts:
such a layer is fetched from the same registry, or the import fails.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import IO, cast

from .build import LayerStream, build_from_layers
from .errors import UnsupportedManifest
from .layer import Layer, LayerKind, check_name, check_tag
from .oci import host_arch
from .registry import Descriptor, Manifest, RegistryClient, RegistryRef
from .store import LayerStore

Progress = Callable[[str, int, int | None], None]

OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar.zstd",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
}
"""Layer media types an import applies: tars, plain, gzip or zstd."""
_MAX_NESTING = 4


def pick_platform(index: Manifest, *, os: str = "linux", arch: str | None = None) -> Descriptor:
    """The manifest of an index for ``os/arch`` (default: this machine's architecture).

    Attestations (``unknown/unknown``, or annotated as attestation manifests) are
    skipped. :class:`UnsupportedManifest` listing the platforms on offer when none fits."""
    arch = arch or host_arch()
    offered: list[str] = []
    for d in index.manifests:
        plat = d.platform
        annotations = d.extra.get("annotations") or {}
        if isinstance(annotations, dict) and "vnd.docker.reference.type" in annotations:
            continue  # buildkit's attestation manifests
        p_os, p_arch = str(plat.get("os", "")), str(plat.get("architecture", ""))
        offered.append(f"{p_os or '?'}/{p_arch or '?'}" + (f"/{plat['variant']}" if plat.get("variant") else ""))
        if p_os == os and p_arch == arch:
            return d
    raise UnsupportedManifest(
        f"{index.where} has no {os}/{arch} image (it offers: {', '.join(offered) or 'nothing'}); "
        "DSec runs images of this machine's platform", media_type=index.media_type,
    )  # fmt: skip


def resolve_image(client: RegistryClient, repo: str, reference: str, *, arch: str | None = None) -> Manifest:
    """The image manifest ``repo:reference`` names for this platform (through indexes)."""
    m = client.get_manifest(repo, reference)
    for _ in range(_MAX_NESTING):
        if not m.is_index:
            break
        m = client.get_manifest(repo, pick_platform(m, arch=arch).digest)
    if m.is_index:
        raise UnsupportedManifest(f"{m.where}: image indexes are nested too deeply", media_type=m.media_type)
    if m.is_dsec_layer:
        raise UnsupportedManifest(
            f"{m.where} is a DSec layer, not a container image: fetch it with `dsec image pull`",
            media_type=m.media_type,
        )  # fmt: skip
    return m


def import_image(
    store: LayerStore,
    client: RegistryClient,
    src: RegistryRef,
    *,
    name: str | None = None,
    tag: str | None = None,
    kind: LayerKind | str = LayerKind.BASE,
    arch: str | None = None,
    progress: Progress | None = None,
) -> Layer:
    """Flatten the container image ``src`` into one layer of ``store``.

    ``name`` defaults to the repository's last path component, ``tag`` to the
    reference's tag (or the manifest digest's first 12 hex digits)."""
    name = check_name(name or src.repo.rsplit("/", 1)[-1])
    tag = check_tag(tag or src.tag or (src.digest or "").split(":")[-1][:12] or "latest")
    m = resolve_image(client, src.repo, src.reference, arch=arch)
    cfg = m.config
    if cfg.media_type not in (OCI_CONFIG, DOCKER_CONFIG):
        raise UnsupportedManifest(
            f"{m.where}: config media type {cfg.media_type!r} is not a container image's ({OCI_CONFIG}); "
            "DSec imports container images only", media_type=cfg.media_type,
        )  # fmt: skip
    _check_config_platform(client, src.repo, cfg, m, arch=arch or host_arch())
    layers = m.layers
    for i, d in enumerate(layers):
        if d.media_type not in LAYER_TYPES:
            raise UnsupportedManifest(
                f"{m.where}: layer {i + 1}/{len(layers)} ({d.digest}) has media type {d.media_type!r}, which "
                "is not a tar layer (plain, gzip or zstd)", media_type=d.media_type,
            )  # fmt: skip
    streams = [
        LayerStream(
            open=_opener(client, src.repo, d),
            media_type=d.media_type,
            digest=d.digest,
            size=d.size,
            where=f"{m.where}: layer {i + 1}/{len(layers)} ({d.digest})",
        )
        for i, d in enumerate(layers)
    ]
    return build_from_layers(store, streams, name=name, tag=tag, kind=kind, progress=progress, source=m.where)


def _opener(
    client: RegistryClient, repo: str, d: Descriptor
) -> Callable[[], contextlib.AbstractContextManager[IO[bytes]]]:
    def open_() -> contextlib.AbstractContextManager[IO[bytes]]:
        # A BlobReader reads like a file (read(n)); the applier needs nothing else.
        return cast("contextlib.AbstractContextManager[IO[bytes]]", client.open_blob(repo, d.digest, size=d.size))

    return open_


def _check_config_platform(client: RegistryClient, repo: str, cfg: Descriptor, m: Manifest, *, arch: str) -> None:
    """A single-platform image for another architecture would not run: refuse it now."""
    try:
        doc = json.loads(client.get_blob(repo, cfg.digest))
    except ValueError:
        raise UnsupportedManifest(f"{m.where}: the image config is not JSON", media_type=cfg.media_type) from None
    if not isinstance(doc, dict):
        raise UnsupportedManifest(f"{m.where}: the image config is not a JSON object", media_type=cfg.media_type)
    got_os, got_arch = doc.get("os"), doc.get("architecture")
    if (got_os not in (None, "", "linux")) or (got_arch not in (None, "", arch)):
        raise UnsupportedManifest(
            f"{m.where} is a {got_os}/{got_arch} image; this machine runs linux/{arch} images",
            media_type=cfg.media_type,
        )  # fmt: skip


__all__ = ["LAYER_TYPES", "import_image", "pick_platform", "resolve_image"]
