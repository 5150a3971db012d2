"""Image-specific refinements of :class:`dsec.errors.ImageError`.

They keep ImageError's wire code, so a remote caller sees an ImageError with the
same message and fields; in-process callers can catch the finer class.
"""

from __future__ import annotations

from typing import Any

from dsec.errors import ImageError


class LayerBuildError(ImageError):
    """Building a layer failed; ``stage`` names the step (extract, mkfs, debootstrap...)."""


class StorageFull(LayerBuildError, OSError):
    """The layer store's filesystem filled up while a layer was being made (``stage``,
    ``path``); nothing of the half-made layer is kept."""


class UnsafeArchive(LayerBuildError, ValueError):
    """An archive tried to write outside its root (``..``, links out) or is malformed."""


class RegistryError(ImageError):
    """An OCI registry refused or failed a request, or sent something unusable.

    Fields: ``status`` (HTTP status, 0 when the registry could not be reached),
    ``registry_code`` (the first ``errors[].code`` of the registry's error body, e.g.
    ``BLOB_UNKNOWN``, ``MANIFEST_UNKNOWN``, ``DENIED``; "" when it sent none), ``url``.
    (``code`` itself stays ImageError's wire code.) The message says what to fix.
    """

    def __init__(self, message: str, *, status: int = 0, registry_code: str = "", url: str = "",
                 **fields: Any) -> None:  # fmt: skip
        super().__init__(message, status=status, registry_code=registry_code, url=url, **fields)


class RegistryAuthError(RegistryError, PermissionError):
    """The registry wants credentials it did not get, or refused the ones it got (401/403)."""


class RegistryNotFound(RegistryError, LookupError):
    """The repository, tag, manifest or blob does not exist in the registry (404)."""


class RegistryUnreachable(RegistryError, ConnectionError):
    """No answer from the registry (connection refused, DNS, timeout); ``status`` is 0."""


class UnsupportedManifest(RegistryError, ValueError):
    """A manifest, index, config or layer of a media type DSec cannot use (``media_type``)."""


class DigestMismatch(RegistryError):
    """Bytes from the registry do not hash to the digest that names them (``expected``,
    ``got``, and ``chunk`` when one chunk of a layer is wrong): a corrupt or malicious
    registry; nothing of them is kept."""


__all__ = [
    "DigestMismatch",
    "LayerBuildError",
    "RegistryAuthError",
    "RegistryError",
    "RegistryNotFound",
    "RegistryUnreachable",
    "StorageFull",
    "UnsafeArchive",
    "UnsupportedManifest",
]
