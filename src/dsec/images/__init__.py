"""Image layers: immutable, content-addressed EROFS files, their store and mounts.

A sandbox's root filesystem is up to three kinds of read-only layers (base,
workspace, toolkits) stacked with overlayfs under a writable upper. This
package builds layers (:mod:`.build`), keeps them (:class:`LayerStore`,
:class:`LocalLayerStore`) and mounts each once per node (:class:`LayerMounts`).
"""

from __future__ import annotations

from .build import (
    Progress,
    build_busybox,
    build_debootstrap,
    build_from_dir,
    build_from_oci,
    build_from_tar,
)
from .busybox import build_busybox_rootfs
from .errors import LayerBuildError, UnsafeArchive
from .layer import Layer, LayerKind, ParsedRef, parse_ref
from .mounts import LayerMounts
from .store import LayerStore, LocalLayerStore

__all__ = [
    "Layer",
    "LayerBuildError",
    "LayerKind",
    "LayerMounts",
    "LayerStore",
    "LocalLayerStore",
    "ParsedRef",
    "Progress",
    "UnsafeArchive",
    "build_busybox",
    "build_busybox_rootfs",
    "build_debootstrap",
    "build_from_dir",
    "build_from_oci",
    "build_from_tar",
    "parse_ref",
]
