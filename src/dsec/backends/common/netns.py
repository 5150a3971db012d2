"""A sandbox's network namespace as the host wires it: a veth pair, addresses and routes
through a link-local gateway, and the baseline nftables table with its policy generations.
Used by the network manager (:mod:`network`) and by its helper process (:mod:`netmaker`)."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from dsec.backends.common import netfilter
from dsec.errors import HostError

GATEWAY = "169.254.1.1"


class SlotTaken(HostError):
    """The link name or the address of a slot is held by someone else on this host."""


@dataclass(frozen=True, slots=True)
class Element:
    cidr: str
    proto: str  # "tcp" | "udp"
    ports: str  # "LO-HI" or "N"

    def nft(self) -> str:
        return f"{self.cidr} . {self.proto} . {self.ports}"

    def admits(self, addr: str, port: int, proto: str = "tcp") -> bool:
        lo, _, hi = self.ports.partition("-")
        return (proto == self.proto and int(lo) <= port <= int(hi or lo)
                and ipaddress.ip_address(addr) in ipaddress.ip_network(self.cidr))


# The table inside every networked sandbox's namespace. A policy is a *generation*:
# its own allow-set aN and chains oN/iN, switched to by inserting ``goto oN`` /
# ``goto iN`` at the head of the base chains. Nothing is deleted on the way (any
# deletion in an nftables transaction waits for an RCU grace period, ~16 ms here;
# adding costs ~0.5 ms), so a switch is fast and atomic; older generations are
# removed later, off the caller's path (``_gc``).
_BASELINE = """
add table inet dsec
delete table inet dsec
table inet dsec {{
  set never4 {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {never} }} }}
  set denied4 {{ type ipv4_addr . inet_proto . inet_service; size 256; flags dynamic, timeout; timeout 1h; }}
  counter denied {{ }}
  chain deny {{
    meta l4proto {{ tcp, udp }} update @denied4 {{ ip daddr . meta l4proto . th dport }}
    counter name denied
    meta l4proto tcp reject with tcp reset
    reject with icmpx admin-prohibited
  }}
  chain output {{
    type filter hook output priority 0; policy drop;
  }}
  chain input {{
    type filter hook input priority 0; policy drop;
  }}
  chain forward {{
    type filter hook forward priority 0; policy drop;
  }}
}}
"""


GUEST_LINK = "vm0"
"""A VM's tap in its sandbox's namespace: what the guest sends is forwarded, not sent, so the
``forward`` chain sends it through the same generation chains as a process's packets (output
for what the guest sends, input for what comes back). Containers have no such link."""
FORWARD_CHAIN = "add chain inet dsec forward { type filter hook forward priority 0; policy drop; }\n"
"""In the baseline; added to a table wired before it existed when a generation first needs it
(:meth:`NetworkManager._apply_in`), never on every switch: re-adding a base chain in a
transaction costs it a hook update, ~10 ms (measured: set_policy 1.6 -> 14 ms)."""


def generation_cmd(gen: int, elements: Sequence[Element]) -> str:
    """One transaction adding policy generation ``gen`` and making it the one in force."""
    elems = f" elements = {{ {', '.join(e.nft() for e in elements)} }} ;" if elements else ""
    return (
        f"add set inet dsec a{gen} {{ type ipv4_addr . inet_proto . inet_service; flags interval;{elems} }}\n"
        f"add chain inet dsec o{gen}\n"
        f"add rule inet dsec o{gen} oifname \"lo\" accept\n"
        # what the namespace itself sends a VM's guest (the resets and ICMP errors of refused
        # packets): only the guest is behind that link, whatever its address is elsewhere
        f"add rule inet dsec o{gen} oifname \"{GUEST_LINK}\" accept\n"
        f"add rule inet dsec o{gen} ip daddr @never4 goto deny\n"
        f"add rule inet dsec o{gen} ip daddr . meta l4proto . th dport @a{gen} accept\n"
        f"add rule inet dsec o{gen} goto deny\n"
        f"add chain inet dsec i{gen}\n"
        f"add rule inet dsec i{gen} iifname \"lo\" accept\n"
        f"add rule inet dsec i{gen} ct state established,related ip saddr . meta l4proto . th sport @a{gen} accept\n"
        f"add rule inet dsec i{gen} ct state related meta l4proto icmp accept\n"
        f"add rule inet dsec i{gen} drop\n"
        f"insert rule inet dsec output goto o{gen}\n"
        f"insert rule inet dsec input goto i{gen}\n"
        f"{forward_gotos(gen, 'insert')}"
    )


def forward_gotos(gen: int, verb: str) -> str:
    """The ``forward`` chain's two rules for generation ``gen`` (``verb``: insert or add)."""
    return (f"{verb} rule inet dsec forward iifname \"{GUEST_LINK}\" goto o{gen}\n"
            f"{verb} rule inet dsec forward oifname \"{GUEST_LINK}\" goto i{gen}\n")


def wire_netns(ip: str, ifname: str, never: str, into_fd: int | None = None) -> int:
    """Make (or, with ``into_fd``, wire up an existing) sandbox network namespace:
    lo up; ``eth0`` with ``ip``/32 and a default route through the link-local gateway
    (static neighbour entry: no ARP/proxy-ARP needed); host end ``ifname`` up with a
    /32 route back; IPv6 off; the baseline table (deny all but loopback). Returns the
    namespace fd. On failure nothing is left (the namespace and the link go)."""
    from pyroute2 import IPRoute  # the server extra; imported when first needed
    from pyroute2.netlink.exceptions import NetlinkError

    fd = netfilter.new_netns() if into_fd is None else os.dup(into_fd)
    try:
        with IPRoute() as host:
            try:
                host.link("add", ifname=ifname, kind="veth", peer={"ifname": "eth0", "net_ns_fd": fd})
            except NetlinkError as exc:
                if exc.code == errno.EEXIST:
                    raise SlotTaken(f"link {ifname} exists") from None
                raise
            idx = host.link_lookup(ifname=ifname)[0]
            host.link("set", index=idx, state="up")
            try:
                # "add", never "replace": the /32 route is how addresses stay unique
                # across runtimes sharing a subnet on this host.
                host.route("add", dst=f"{ip}/32", oif=idx)
            except NetlinkError as exc:
                host.link("del", index=idx)
                if exc.code == errno.EEXIST:
                    raise SlotTaken(f"address {ip} is routed elsewhere") from None
                raise
            mac = host.get_links(idx)[0].get_attr("IFLA_ADDRESS")

        def inside() -> None:
            netfilter.write_sysctls([
                ("net.ipv6.conf.all.disable_ipv6", "1"),
                ("net.ipv6.conf.default.disable_ipv6", "1"),
            ])
            with IPRoute() as ns:
                lo = ns.link_lookup(ifname="lo")[0]
                ns.link("set", index=lo, state="up")
                eth = ns.link_lookup(ifname="eth0")[0]
                ns.addr("add", index=eth, address=ip, prefixlen=32)
                ns.link("set", index=eth, state="up")
                ns.route("add", dst=f"{GATEWAY}/32", oif=eth, scope=253)
                ns.route("add", dst="0.0.0.0/0", gateway=GATEWAY, oif=eth)
                ns.neigh("add", dst=GATEWAY, lladdr=mac, ifindex=eth, state=0x80)  # NUD_PERMANENT
            netfilter.nft(_BASELINE.format(never=never) + generation_cmd(0, []))

        netfilter.in_netns(fd, inside)
    except Exception as exc:
        os.close(fd)
        if not isinstance(exc, SlotTaken):
            with contextlib.suppress(Exception), IPRoute() as host:
                for idx in host.link_lookup(ifname=ifname):
                    host.link("del", index=idx)
        if isinstance(exc, HostError):
            raise
        raise HostError(f"cannot prepare a sandbox network namespace: {exc}") from exc
    return fd


def _resolve_v4(host: str) -> list[str]:
    infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    return sorted({str(i[4][0]) for i in infos})


def _host_ipv4_addrs() -> set[str]:
    """Every IPv4 address configured on the host (they are the host: never reachable)."""
    from pyroute2 import IPRoute

    out: set[str] = set()
    with IPRoute() as ip:
        for a in ip.get_addr(family=socket.AF_INET):
            addr = a.get_attr("IFA_LOCAL") or a.get_attr("IFA_ADDRESS")
            if addr:
                out.add(f"{addr}/32")
    return out


__all__ = ["FORWARD_CHAIN", "GATEWAY", "GUEST_LINK", "Element", "SlotTaken", "forward_gotos", "generation_cmd", "wire_netns"]
