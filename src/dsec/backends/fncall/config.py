"""The FnCall backend's part of an edge's configuration (``EdgeConfig.backends``): pure data.

Sizes are bytes, times seconds. Per-call limits have a default (used when a call
leaves them out) and a ceiling (a call asking for more is refused with
``InvalidSpec``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsec.spec import ImageRef, Resources

if TYPE_CHECKING:
    from dsec.backends import BackendContext
    from dsec.backends.base import Backend


MiB = 1024 * 1024
_MODULE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


def _worker_resources() -> Resources:
    return Resources(cpu=4.0, memory=4096 * MiB, pids=4096, disk=1024 * MiB, nofile=4096)


class FnCallImage(BaseModel):
    """Warm workers for one image."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: ImageRef
    preload: tuple[Annotated[str, Field(pattern=_MODULE)], ...] = ()
    """Modules the template imports once (``numpy``, ``sympy``...); a module that fails to
    import fails the worker's start (the image lacks it)."""
    workers: Annotated[int, Field(ge=1, le=64)] = 1
    """Worker sandboxes for this image, started with the pool."""
    concurrency: Annotated[int, Field(ge=1, le=256)] = 4
    """Calls in flight per worker; each has its own uid and process tree."""
    spare: Annotated[int, Field(ge=0, le=64)] = 2
    """Call processes forked ahead per worker beyond ``concurrency``, so a call never waits
    for the previous one on its slot to be cleaned up."""
    resources: Resources = Field(default_factory=_worker_resources)
    """The worker sandbox's limits, shared by its template and its calls."""
    python: Annotated[str, Field(pattern=r"^[A-Za-z0-9_./+-]{1,128}$")] = "python3"
    """The image's interpreter (a name on the image's PATH, or a path)."""


class FnCallConfig(BaseModel):
    """Function calls served by warm, pre-imported Python workers (docs/FNCALL.md)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["fncall"] = "fncall"
    images: tuple[FnCallImage, ...] = ()
    """Images with workers started at start-up."""
    lazy_images: bool = True
    """A call for an image not listed starts a worker for it on first use (no preloads,
    ``lazy_concurrency`` calls in flight); False: such a call is refused."""
    lazy_concurrency: Annotated[int, Field(ge=1, le=256)] = 4
    call_timeout_s: Annotated[float, Field(gt=0, le=86400)] = 10.0
    """Default wall-clock limit of a call."""
    max_call_timeout_s: Annotated[float, Field(gt=0, le=86400)] | None = 300.0
    """Ceiling on a call's ``timeout`` (None: none; a call may then ask for no timeout)."""
    call_memory: Annotated[int, Field(ge=16 * MiB, le=1 << 40)] = 512 * MiB
    """Default memory a call may map on top of the warm template (RLIMIT_AS)."""
    max_call_memory: Annotated[int, Field(ge=16 * MiB, le=1 << 40)] = 4096 * MiB
    output_cap: Annotated[int, Field(ge=1024, le=256 * MiB)] = 1 * MiB
    """Default cap on each of a call's stdout, stderr and JSON result."""
    max_output_cap: Annotated[int, Field(ge=1024, le=256 * MiB)] = 64 * MiB
    max_request_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 64 * MiB
    """A call's source and arguments, JSON-encoded, at most."""
    call_processes: Annotated[int, Field(ge=1, le=4096)] = 64
    """Processes one call may have at once (RLIMIT_NPROC of its uid)."""
    call_file_size: Annotated[int, Field(ge=0, le=1 << 40)] = 256 * MiB
    """Largest file a call may write (RLIMIT_FSIZE)."""
    call_nofile: Annotated[int, Field(ge=64, le=1 << 20)] = 1024
    max_queue: Annotated[int, Field(ge=0, le=1 << 20)] = 100_000
    """Calls waiting for a free slot per image beyond which a call is refused with Backpressure."""
    call_uid_base: Annotated[int, Field(ge=1000, le=60000)] = 40000
    """Calls of a worker run as uids ``call_uid_base + slot`` inside its sandbox."""
    start_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 180.0
    """A worker that is not ready by then (image pull, preload) counts as failed."""
    answer_grace_s: Annotated[float, Field(gt=0, le=600)] = 10.0
    """A worker that has not answered a call this long after its timeout is declared lost."""

    @model_validator(mode="after")
    def _ceilings(self) -> FnCallConfig:
        if self.max_call_timeout_s is not None and self.call_timeout_s > self.max_call_timeout_s:
            raise ValueError("call_timeout_s is above max_call_timeout_s")
        if self.call_memory > self.max_call_memory:
            raise ValueError("call_memory is above max_call_memory")
        if self.output_cap > self.max_output_cap:
            raise ValueError("output_cap is above max_output_cap")
        return self

    def image_config(self, image: ImageRef) -> FnCallImage | None:
        return next((c for c in self.images if c.image == image), None)

    def build(self, ctx: BackendContext) -> Backend:
        """The FnCall backend this config describes (not yet started; it runs its workers in
        the edge's container backend)."""
        from dsec.backends.fncall import build_backend  # the backend's own code, imported now

        return build_backend(self, ctx)
