"""Image-specific refinements of :class:`dsec.errors.ImageError`.

They keep ImageError's wire code, so a remote caller sees an ImageError with the
same message and fields; in-process callers can catch the finer class.
"""

from __future__ import annotations

from dsec.errors import ImageError


class LayerBuildError(ImageError):
    """Building a layer failed; ``stage`` names the step (extract, mkfs, debootstrap...)."""


class StorageFull(LayerBuildError, OSError):
    """The layer store's filesystem filled up while a layer was being made (``stage``,
    ``path``); nothing of the half-made layer is kept."""


class UnsafeArchive(LayerBuildError, ValueError):
    """An archive tried to write outside its root (``..``, links out) or is malformed."""


__all__ = ["LayerBuildError", "StorageFull", "UnsafeArchive"]
