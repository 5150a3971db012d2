"""Errors of the lazy layer service, refinements of :class:`dsec.errors.ImageError`.

They keep ImageError's wire code (a remote caller sees an ImageError with the same
message and fields); in-process callers catch the finer class. The control channel
between :class:`~dsec.images.lazy.LazyLayers` and its FUSE process carries them by
class name through :data:`ERRORS_BY_NAME`, its one table.
"""

from __future__ import annotations

from dsec.errors import ImageError, LayerInUse
from dsec.errors import LayerUnavailable as _LayerUnavailable


class LazyError(ImageError):
    """Something failed in the lazy layer service (the FUSE process or its control channel)."""


class LayerUnavailable(_LayerUnavailable, LazyError):
    """A layer's chunks cannot be fetched: the registry is unreachable or refused
    (``digest``, ``registry``, ``status``: 0 when nothing answered). A create that needs
    an uncached layer from an unreachable registry fails with this. On the wire it is
    :class:`dsec.errors.LayerUnavailable` (``layer_unavailable``, HTTP 503)."""


class ChunkCorrupt(LazyError):
    """A chunk's bytes do not hash to the chunk table's digest (``digest`` of the layer,
    ``chunk`` index, ``expected``, ``got``): refused, never served, never cached."""


class LayerBusy(LazyError, LayerInUse):
    """The layer's file is open (an EROFS mount holds it): unmount it before detaching."""


class ServiceDown(LazyError, ConnectionError):
    """The FUSE process does not answer on its control socket (``socket``)."""


ERRORS_BY_NAME: dict[str, type[LazyError]] = {
    cls.__name__: cls for cls in (LazyError, LayerUnavailable, ChunkCorrupt, LayerBusy, ServiceDown)
}

__all__ = [
    "ERRORS_BY_NAME",
    "ChunkCorrupt",
    "LayerBusy",
    "LayerUnavailable",
    "LazyError",
    "ServiceDown",
]
