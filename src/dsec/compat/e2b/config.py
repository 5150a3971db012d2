"""Settings of the E2B-compatible front (``ControlConfig.e2b``). Pure data."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

MiB = 1024 * 1024


class E2BTemplate(BaseModel):
    """What one E2B template name starts: a DSec image and the sandbox's size."""

    model_config = ConfigDict(extra="forbid")

    base: str
    """The base layer (``name:tag``) of the sandbox's image."""
    toolkits: tuple[str, ...] = ()
    cpu: Annotated[float, Field(gt=0, le=256)] = 1.0
    memory_mb: Annotated[int, Field(ge=16, le=1 << 20)] = 1024
    disk_mb: Annotated[int, Field(ge=16, le=1 << 20)] = 2048


def _default_templates() -> dict[str, E2BTemplate]:
    return {
        "base": E2BTemplate(base="tc-base:bookworm", toolkits=("tc-python:bookworm",)),
        "code-interpreter-v1": E2BTemplate(base="tc-base:bookworm", toolkits=("tc-jupyter:bookworm",)),
    }


class E2BConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    """Serve E2B's REST API and sandbox plane on the control plane's listener."""
    templates: dict[str, E2BTemplate] = Field(default_factory=_default_templates)
    """Template name (or id) -> image. ``base`` is what a create without a template asks for."""
    image_metadata_key: Annotated[str, Field(min_length=1, max_length=128)] = "image"
    """A create whose ``metadata`` has this key runs that image (``name:tag``) instead of the
    template's, as slime's gateway expects (``SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY``)."""
    backend: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")] = "container"
    default_user: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")] = "user"
    """The user of a process or file call that names none (E2B's templates: ``user``)."""
    max_timeout_s: Annotated[float, Field(gt=0, le=7 * 86400)] = 86400.0
    """A longer sandbox ``timeout`` is refused (400), as E2B does past its plan's limit."""
    lifetime_floor_s: Annotated[float, Field(gt=0, le=7 * 86400)] = 3600.0
    """A sandbox's DSec TTL is at least this (and its E2B ``timeout`` at most): ``set_timeout``
    may extend it up to there; the front kills it at its E2B end. The TTL is the backstop
    should this replica die (its deadlines are in memory)."""
    envd_version: Annotated[str, Field(pattern=r"^\d+\.\d+\.\d+$")] = "0.6.4"
    """Reported in ``envdVersion``: every client feature gate (e2b/envd/versions.py) is at or below it."""
    max_clients: Annotated[int, Field(ge=1, le=4096)] = 64
    """SDK clients (one per API key) kept open by the front."""
    images: dict[str, str] = Field(default_factory=lambda: {"e2bdev/base": "base", "e2bdev/base:latest": "base"})
    """A template build's ``fromImage`` -> a template name here or a DSec layer (``name:tag``).
    ``e2bdev/base`` is what ``Template()`` starts from when no image is given. Other images
    must be layers the cluster holds (``dsec image import``): the front pulls from no registry."""
    ready_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0
    """How long a built template's ready command (``set_start_cmd``'s) may take to pass, in its
    build and in each sandbox made from it."""
    build_network: tuple[str, ...] = ()
    """Named network permissions (the edge's, e.g. ``pkgs``, ``dns``) a template build's sandbox
    gets for its RUN steps (``apt_install``, ``pip_install``). Empty: no network, as any sandbox."""
