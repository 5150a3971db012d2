"""A microVM's network: its NIC's tap in the sandbox's own network namespace.

Every VM of a backend with network gets, at create, a namespace from the node's network
manager (:mod:`dsec.backends.common.network`: ``eth0`` with the sandbox's address, the
platform block list, the policy table that drops by default), exactly as a container does.
In it:

- a tap, ``vm0`` (:data:`~dsec.backends.common.netns.GUEST_LINK`), whose fd QEMU is handed:
  the guest's NIC. It is ``192.0.2.1/30`` with a fixed MAC, the guest ``192.0.2.2`` with a
  fixed MAC (the agent sets its side at boot: ``native/vmagent.h``), both neighbours
  permanent. Every clone and fork child of a template has the same guest addresses, each
  behind its own namespace, so nothing about them is restored into a conflict. The addresses
  are the namespace's own business: they may be real elsewhere (this development host's own
  address is 192.0.2.2), and nothing in the namespace takes them for anything but the guest's
  link (what the namespace sends the guest, e.g. the reset of a refused connection, leaves by
  ``vm0`` whatever its address). A destination inside 192.0.2.0/30 is the guest's own link:
  a VM cannot reach one there.
- forwarding on, and ``ip dsec_vm``: the guest's packets leave ``eth0`` masqueraded to the
  sandbox's address; the ``inet dsec`` table's ``forward`` chain sends them through the same
  policy generation chains as a container's own packets (output for what the guest sends,
  input for what comes back), so ``set_policy``, the block list, the denied counter and
  the host's table hold for a VM unchanged.
- QEMU itself runs in that namespace (:class:`~dsec.backends.microvm.qemu.QemuDriver`
  ``netns_fd``): it holds the namespace for as long as it lives (a restart of the backend
  finds it again through ``/proc/<qemu>/ns/net``), and it reaches nothing the policy does
  not allow (the host's loopback services included).

Root in the guest cannot change any of it: the namespace, its rules and the tap are the
host's; in the guest, commands run without ``CAP_NET_ADMIN``.

Blocking functions: call them on a worker thread (they enter the namespace on it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from typing import Final

from dsec.backends.common import netfilter
from dsec.backends.common.netns import GUEST_LINK
from dsec.errors import HostError

GUEST_IP: Final = "192.0.2.2"
GATEWAY_IP: Final = "192.0.2.1"
PREFIX: Final = 30
GATEWAY_MAC: Final = "02:64:73:65:63:01"
"""The tap's MAC: the guest's permanent neighbour for the gateway (vmagent.h NET_GATEWAY_MAC)."""
GUEST_MAC: Final = "02:64:73:65:63:02"
"""The guest NIC's MAC (the QEMU device's ``mac=``)."""
NAT_TABLE: Final = "dsec_vm"

_TUNSETIFF: Final = 0x400454CA
_IFF_TAP: Final = 0x0002
_IFF_NO_PI: Final = 0x1000

_NAT = f"""
add table ip {NAT_TABLE}
delete table ip {NAT_TABLE}
table ip {NAT_TABLE} {{
  chain post {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "eth0" ip saddr {GUEST_IP} masquerade
  }}
}}
"""


def open_tap(netns_fd: int) -> int:
    """Make the guest's tap in the namespace ``netns_fd``, wired as the module says; returns
    its fd (QEMU's, once handed over: the tap goes when the last holder closes it). On failure
    nothing is left in the namespace."""
    def inside() -> int:
        from pyroute2 import IPRoute

        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", GUEST_LINK.encode(), _IFF_TAP | _IFF_NO_PI))
            with IPRoute() as ip:
                idx = ip.link_lookup(ifname=GUEST_LINK)[0]
                ip.link("set", index=idx, address=GATEWAY_MAC)
                ip.addr("add", index=idx, address=GATEWAY_IP, prefixlen=PREFIX)
                ip.link("set", index=idx, state="up")
                ip.neigh("add", dst=GUEST_IP, lladdr=GUEST_MAC, ifindex=idx, state=0x80)  # NUD_PERMANENT
            netfilter.write_sysctls([("net.ipv4.ip_forward", "1")])
            netfilter.nft(_NAT)
        except BaseException:
            os.close(fd)  # the tap goes with its only fd
            with contextlib.suppress(Exception):
                _unwire()
            raise
        return fd

    try:
        return netfilter.in_netns(netns_fd, inside)
    except HostError:
        raise
    except Exception as exc:
        raise HostError(f"cannot make the VM's tap in its network namespace: {exc}") from exc


def _unwire() -> None:
    netfilter.write_sysctls([("net.ipv4.ip_forward", "0")])
    with contextlib.suppress(netfilter.NftError):
        netfilter.nft(f"delete table ip {NAT_TABLE}")


def close_tap(netns_fd: int) -> None:
    """What :func:`open_tap` set besides the tap (forwarding, the NAT table) removed, once
    QEMU (the tap's holder) is gone: the namespace can go back to the pool for any sandbox."""
    def inside() -> None:
        from pyroute2 import IPRoute

        with IPRoute() as ip:
            for idx in ip.link_lookup(ifname=GUEST_LINK):
                ip.link("del", index=idx)
        _unwire()

    netfilter.in_netns(netns_fd, inside)


def qemu_netns(pid: int) -> int | None:
    """An fd of the network namespace QEMU ``pid`` runs in (None when it is gone)."""
    try:
        return os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


__all__ = ["GATEWAY_IP", "GATEWAY_MAC", "GUEST_IP", "GUEST_MAC", "NAT_TABLE", "close_tap", "open_tap",
           "qemu_netns"]
