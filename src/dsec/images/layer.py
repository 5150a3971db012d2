"""The layer record and layer references: pure data, no I/O.

A layer is an immutable EROFS image named by the sha256 of its bytes. People
refer to layers as ``NAME[:TAG]`` (tag defaults to ``latest``) or by digest,
``sha256:<64 hex>``; a digest may be shortened to a unique prefix of at least
:data:`MIN_DIGEST_PREFIX` hex digits when resolving against a store.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, field_validator

from dsec.errors import InvalidSpec

DIGEST_PREFIX = "sha256:"
DEFAULT_TAG = "latest"
MIN_DIGEST_PREFIX = 8

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX_PREFIX = re.compile(rf"^[0-9a-f]{{{MIN_DIGEST_PREFIX},64}}$")
# Same grammar as dsec.spec's ImageRef so every ref a spec accepts resolves here.
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
_TAG = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class LayerKind(enum.StrEnum):
    """What a layer is for; the overlay stacks base < workspace < toolkits."""

    BASE = "base"
    WORKSPACE = "workspace"
    TOOLKIT = "toolkit"
    SNAPSHOT = "snapshot"


class Layer(BaseModel):
    """One stored layer under one name:tag. Immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    digest: str
    """``sha256:<hex>`` of the EROFS file's bytes."""
    name: str
    tag: str
    kind: LayerKind
    size: int
    """Bytes of the EROFS file."""
    created_at: float
    """Unix time the layer's content first entered the store."""
    parents: tuple[str, ...] = ()
    """Digests of the layers this one was built on, nearest first."""
    source: str | None = None
    """``<registry URL>/<repo>`` when the layer's bytes come from a registry, loaded lazily
    (the store holds its chunk table, not its file); None for a layer held as a local file."""

    @field_validator("digest")
    @classmethod
    def _digest(cls, v: str) -> str:
        return check_digest(v)

    @field_validator("parents")
    @classmethod
    def _parents(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_digest(p) for p in v)

    @property
    def hex(self) -> str:
        return self.digest[len(DIGEST_PREFIX) :]

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"


def is_digest(value: str) -> bool:
    return value.startswith(DIGEST_PREFIX) and bool(_HEX64.match(value[len(DIGEST_PREFIX) :]))


def check_digest(value: str) -> str:
    """Return ``value`` if it is a full ``sha256:<64 hex>`` digest, else raise InvalidSpec."""
    if not is_digest(value):
        raise InvalidSpec(
            f"{value!r} is not a layer digest: expected 'sha256:' followed by 64 lowercase hex digits",
            field="digest",
        )
    return value


def digest_hex(digest: str) -> str:
    return check_digest(digest)[len(DIGEST_PREFIX) :]


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise InvalidSpec(
            f"bad layer name {name!r}: use 1-128 characters of a-z 0-9 . _ - "
            "starting with a letter or digit",
            field="name",
        )
    return name


def check_tag(tag: str) -> str:
    if not _TAG.match(tag):
        raise InvalidSpec(
            f"bad layer tag {tag!r}: use 1-128 characters of A-Z a-z 0-9 . _ -", field="tag"
        )
    return tag


def check_kind(kind: str | LayerKind) -> LayerKind:
    try:
        return LayerKind(kind)
    except ValueError:
        choices = ", ".join(k.value for k in LayerKind)
        raise InvalidSpec(
            f"bad layer kind {kind!r}: choose one of {choices}", field="kind"
        ) from None


@dataclass(frozen=True)
class ParsedRef:
    """A parsed layer reference: either a (possibly shortened) digest or name+tag."""

    digest_hex: str | None = None
    """Hex digits after ``sha256:`` (full or a unique prefix)."""
    name: str | None = None
    tag: str | None = None

    @property
    def is_digest(self) -> bool:
        return self.digest_hex is not None

    @property
    def is_full_digest(self) -> bool:
        return self.digest_hex is not None and len(self.digest_hex) == 64


def parse_ref(ref: str) -> ParsedRef:
    """Parse ``NAME[:TAG]`` or ``sha256:<hex>`` (hex may be a prefix of >= 8 digits).

    Raises InvalidSpec naming what is wrong with the reference.
    """
    ref = ref.strip()
    if ref.startswith(DIGEST_PREFIX):
        hexpart = ref[len(DIGEST_PREFIX) :]
        if not _HEX_PREFIX.match(hexpart):
            raise InvalidSpec(
                f"bad layer reference {ref!r}: after 'sha256:' give {MIN_DIGEST_PREFIX} to 64 "
                "lowercase hex digits",
                field="ref",
            )
        return ParsedRef(digest_hex=hexpart)
    name, sep, tag = ref.partition(":")
    if not sep:
        tag = DEFAULT_TAG
    if not _NAME.match(name) or not _TAG.match(tag):
        raise InvalidSpec(
            f"bad layer reference {ref!r}: use NAME[:TAG] (lowercase name of a-z 0-9 . _ -) "
            "or sha256:<hex digest>",
            field="ref",
        )
    return ParsedRef(name=name, tag=tag)


__all__ = [
    "DEFAULT_TAG",
    "DIGEST_PREFIX",
    "Layer",
    "LayerKind",
    "ParsedRef",
    "check_digest",
    "check_kind",
    "check_name",
    "check_tag",
    "digest_hex",
    "is_digest",
    "parse_ref",
]
