"""Sandbox networking's configuration (``ContainerConfig.network``): named permissions,
always-blocked ranges, the prepared-namespace pool. Pure data: the manager that applies it
is :mod:`network`."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dsec.backends.common.claims import AUTO
from dsec.spec import NetRule

ALWAYS_BLOCKED: tuple[str, ...] = (
    "0.0.0.0/8",
    "127.0.0.0/8",
    "169.254.0.0/16",  # link-local, incl. cloud metadata 169.254.169.254
    "100.100.100.200/32",  # Alibaba metadata
    "224.0.0.0/4",
    "240.0.0.0/4",
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Permission(_Model):
    """A named set of destinations defined by the edge operator (``pkgs``, ``dns``, ...)."""

    hosts: tuple[str, ...] = ()
    """Host names, resolved (IPv4) when a policy is applied and again every ``resolve_interval_s``."""
    cidrs: tuple[str, ...] = ()
    ports: tuple[str, ...] = ()
    """Ports or ranges; empty means every port."""
    protocol: Literal["tcp", "udp", "any"] = "tcp"

    @field_validator("cidrs")
    @classmethod
    def _cidrs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(NetRule(cidr=c).cidr for c in v)

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return NetRule(cidr="0.0.0.0/0", ports=v).ports


class NetworkConfig(_Model):
    """The edge's network settings (edge configuration, section ``network``)."""

    subnet: str = AUTO
    """Sandbox addresses (one /32 each). Must not overlap anything the host routes.
    ``"auto"``: a free /16 of 10.224-10.254 that no other DSec instance on the host holds
    and the host does not route, picked when the network starts (:func:`claims.pick_subnet`)."""
    permissions: dict[str, Permission] = Field(default_factory=dict)
    blocked: tuple[str, ...] = ()
    """Extra ranges no sandbox may reach whatever its policy (e.g. the control plane's)."""
    pool_size: Annotated[int, Field(ge=0, le=4096)] = 16
    """Prepared namespaces kept ready (0: make each one on demand, ~10 ms)."""
    resolve_interval_s: Annotated[float, Field(ge=1)] = 300.0
    egress_nat: bool = True
    """Masquerade sandbox traffic leaving the host (needed to reach the Internet)."""

    @field_validator("subnet")
    @classmethod
    def _subnet(cls, v: str) -> str:
        if v == AUTO:
            return v
        try:
            net = ipaddress.IPv4Network(v, strict=True)
        except ValueError as exc:
            raise ValueError(f"subnet {v!r}: {exc}; use an IPv4 CIDR such as 10.213.0.0/16, or \"auto\"") from None
        if net.prefixlen > 28:
            raise ValueError(f"subnet {v!r} is too small: use /28 or larger")
        return str(net)

    @field_validator("blocked")
    @classmethod
    def _blocked(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(NetRule(cidr=c).cidr for c in v)

    def with_platform(self, addrs: Iterable[str]) -> NetworkConfig:
        """This config with the platform's own addresses (IPv4, ``a.b.c.d/32``) added to
        ``blocked``, each once and only where no range already covers it (nftables interval
        sets refuse overlaps)."""
        out = list(self.blocked)
        for a in addrs:
            ip = ipaddress.ip_network(a, strict=False).network_address
            if not any(ip in ipaddress.ip_network(b) for b in out):
                out.append(f"{ip}/32")
        return self.model_copy(update={"blocked": tuple(out)})


__all__ = ["ALWAYS_BLOCKED", "NetworkConfig", "Permission"]
