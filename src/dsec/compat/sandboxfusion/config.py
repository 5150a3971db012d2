"""Settings of the SandboxFusion-compatible API (``ControlConfig.sandboxfusion``). Pure data."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsec.spec.api import NAME_PATTERN

MiB = 1024 * 1024


LOOPBACK: Final = ("127.0.0.0/8", "::1/128")


class ListenerConfig(BaseModel):
    """``[sandboxfusion.listener]``: SandboxFusion's routes at the root of a port of their own,
    with no token, every call charged to ``project`` (listener.py). For clients with no place
    for a token (SkyRL's verifier posts to ``http://<host>:8080/run_code``)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    host: str = "127.0.0.1"
    """The address to bind: loopback by default. Another needs ``allow`` set to the networks
    that may call (everyone who reaches it spends ``project``'s quota)."""
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    project: Annotated[str | None, Field(pattern=NAME_PATTERN)] = None
    """The project every call runs as (its quota, its sandboxes); required when enabled."""
    allow: tuple[str, ...] = LOOPBACK
    """Networks (CIDR) whose peers are served; others get 403."""

    @model_validator(mode="after")
    def _check(self) -> ListenerConfig:
        nets = self.networks()  # every entry parses
        if not self.enabled:
            return self
        if self.project is None:
            raise ValueError("sandboxfusion.listener: `project` is required (the project every call is charged to)")
        try:
            loopback = ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            loopback = self.host == "localhost"
        if not loopback and self.allow == LOOPBACK:
            raise ValueError(f"sandboxfusion.listener: host {self.host!r} is not loopback: list the networks that "
                             "may call it in `allow` (whoever reaches it spends the project's quota)")
        if any(n.prefixlen == 0 for n in nets):
            raise ValueError("sandboxfusion.listener: `allow` may not hold a /0 (everyone): name the networks")
        return self

    def networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        try:
            return tuple(ipaddress.ip_network(a, strict=False) for a in self.allow)
        except ValueError as exc:
            raise ValueError(f"sandboxfusion.listener.allow: {exc}") from None


class SandboxFusionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    """Serve ``<prefix>/run_code``, ``<prefix>/run_jupyter`` and ``<prefix>/v1/ping``."""
    prefix: Annotated[str, Field(pattern=r"^(/[a-z0-9][a-z0-9_.-]*)+$")] = "/sandboxfusion"
    suite: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")] = "bookworm"
    """The tag of the toolchain layers (``tc-base:<suite>``, ``tc-<language>:<suite>``)."""
    profile: Literal["sandboxfusion"] | None = None
    """Library layers over the toolchains (``dsec image build --toolchains ... --profile
    sandboxfusion``): numpy, pandas... for python, lodash for node, testify for go, as in
    SandboxFusion's image. None: the toolchains alone (Debian's interpreters, standard
    libraries only)."""
    backend: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")] = "container"
    cpu: Annotated[float, Field(gt=0, le=256)] = 1.0
    """Cores of each request's sandbox (a CFS quota: compile and run get one core)."""
    default_memory_mb: Annotated[int, Field(ge=16, le=1 << 20)] = 1024
    """The memory limit of a request that gives none (``memory_limit_MB`` -1 or left out)."""
    max_memory_mb: Annotated[int, Field(ge=16, le=1 << 20)] = 16384
    """A larger ``memory_limit_MB`` is refused (422); a smaller one than 16 gets 16."""
    disk_mb: Annotated[int, Field(ge=16, le=1 << 20)] = 1024
    pids: Annotated[int, Field(ge=16, le=1 << 20)] = 512
    output_cap: Annotated[int, Field(ge=1024, le=64 * MiB)] = 1 * MiB
    """Bytes of each stage's stdout and stderr sent back (SandboxFusion sends up to 1 MiB)."""
    max_timeout_s: Annotated[float, Field(gt=0, le=86400)] = 3600.0
    """Longer ``compile_timeout`` / ``run_timeout`` / ``total_timeout`` are refused (422)."""
    ceiling: Annotated[int, Field(ge=1, le=100_000)] = 512
    """At most this many sandboxes in flight for this API per control-plane replica; fewer
    when the cluster refuses creates (compat/window.py)."""
    queue_timeout_s: Annotated[float, Field(gt=0, le=3600)] | None = None
    """How long a request may wait for room before it is answered 504 (which both verl and
    the sandbox-fusion client retry). None (the default): as long as the client's own
    timeout leaves it room to run, at least 10 s. verl's client gives a request its compile
    and run timeouts plus 10 s, so a request that compiles waits 10 s; one with no compile
    stage (python) never spends its compile timeout and waits that much longer (18 s at
    10 + 10 s): a wave of sandboxes that each run into their timeout is waited out, not
    refused and retried behind newer requests. A number: exactly that bound."""
    max_waiting: Annotated[int, Field(ge=0, le=1_000_000)] = 4096
    """Requests waiting for room beyond this are answered 504 at once."""
    retry_hold_s: Annotated[float, Field(ge=0, le=60)] = 4.0
    """A request answered 504 keeps its place in the queue this long for the client's retry
    of the same request (verl retries after 1 s, then 2 s; 0: no place is kept)."""
    listener: ListenerConfig = ListenerConfig()
    """A token-free listener for SkyRL-style clients (off by default)."""

    @model_validator(mode="after")
    def _listener_needs_the_service(self) -> SandboxFusionConfig:
        if self.listener.enabled and not self.enabled:
            raise ValueError("sandboxfusion.listener is enabled but the sandboxfusion service is not")
        return self
