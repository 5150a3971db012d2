"""Small, fast doors into the kernel's network stack for one network namespace.

- :class:`Nft` runs nftables command buffers through libnftables in-process
  (ctypes): an allow-set update costs ~0.1-0.4 ms, against ~3 ms for the ``nft``
  CLI (HOST-FACTS.md, "Network").
- :func:`in_netns` runs a function on a thread that has entered another network
  namespace and always comes back to the host's: the namespace is a per-thread
  attribute, so the rest of the process never notices.
- :func:`destroy_sockets` cuts TCP connections with SOCK_DESTROY (inet_diag), the
  kernel interface behind ``ss -K``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

from dsec.errors import HostError

CLONE_NEWNET = 0x40000000
T = TypeVar("T")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_host_netns_fd: int | None = None
_host_lock = threading.Lock()


def host_netns_fd() -> int:
    """An fd of the network namespace this process started in (kept open for good)."""
    global _host_netns_fd
    with _host_lock:
        if _host_netns_fd is None:
            _host_netns_fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        return _host_netns_fd


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def enter_netns(netns_fd: int) -> None:
    """Move the calling thread into the network namespace ``netns_fd`` for good (a child
    between fork and exec: ``preexec_fn``). Anything else uses :func:`in_netns`."""
    _setns(netns_fd)


def in_netns(netns_fd: int, fn: Callable[[], T]) -> T:
    """Call ``fn`` on this thread inside the namespace ``netns_fd``, then return to the host's.

    Run it on a worker thread (``asyncio.to_thread`` or an executor): if coming back
    ever failed the thread would be stuck in a sandbox's namespace, so that is
    treated as fatal for the process rather than risked.
    """
    home = host_netns_fd()
    _setns(netns_fd)
    try:
        return fn()
    finally:
        try:
            _setns(home)
        except OSError as exc:  # pragma: no cover - cannot happen for our own namespace
            os.write(2, f"dsec: cannot return to the host network namespace: {exc}\n".encode())
            os._exit(70)


def new_netns() -> int:
    """A fresh network namespace (lo down), returned as an fd. Thread-safe."""
    home = host_netns_fd()
    if _libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise HostError(f"unshare(CLONE_NEWNET) failed: {os.strerror(err)}")
    try:
        return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        _setns(home)


# ----- libnftables -----


class NftError(HostError):
    """nftables refused a command buffer (the message is libnftables' own)."""


class _Lib:
    def __init__(self) -> None:
        name = ctypes.util.find_library("nftables") or "libnftables.so.1"
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            raise HostError(
                f"libnftables is not installed ({exc}); install the Debian package libnftables1 "
                "(scripts/setup.sh does)"
            ) from None
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        self.lib = lib


_lib: _Lib | None = None
NFT_CTX_OUTPUT_JSON = 1 << 4


def nft(commands: str, *, json_out: bool = False) -> str:
    """Run an nftables command buffer in the calling thread's network namespace.

    One buffer is one transaction: it applies whole or not at all. A context is
    made per call because libnftables binds its netlink socket to the namespace
    it was made in.
    """
    global _lib
    if _lib is None:
        _lib = _Lib()
    lib = _lib.lib
    ctx = lib.nft_ctx_new(0)
    if not ctx:
        raise NftError("nft_ctx_new failed")
    try:
        lib.nft_ctx_buffer_output(ctx)
        lib.nft_ctx_buffer_error(ctx)
        if json_out:
            lib.nft_ctx_output_set_flags(ctx, NFT_CTX_OUTPUT_JSON)
        rc = lib.nft_run_cmd_from_buffer(ctx, commands.encode())
        if rc != 0:
            err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace").strip()
            raise NftError(f"nftables refused the rules: {err}")
        return (lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
    finally:
        lib.nft_ctx_free(ctx)


# ----- SOCK_DESTROY through inet_diag -----

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_SOCK_DESTROY = 21
_NLM_F_REQUEST = 0x1
_NLM_F_ACK = 0x4
_NLM_F_DUMP = 0x300
_NLMSG_DONE = 3
_NLMSG_ERROR = 2
_TCP_ALL_BUT_LISTEN = 0xFFF & ~(1 << 10)  # every TCP state except LISTEN


def _diag_req(family: int, proto: int, states: int, sock_id: bytes, flags: int, msg_type: int, seq: int) -> bytes:
    body = struct.pack("=BBBBI", family, proto, 0, 0, states) + sock_id
    return struct.pack("=IHHII", 16 + len(body), msg_type, flags, seq, 0) + body


def _tcp_sockets() -> list[tuple[bytes, str, int]]:
    """Every non-listening IPv4 TCP socket of this thread's netns: (inet_diag id, peer, peer port)."""
    out: list[tuple[bytes, str, int]] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        empty_id = b"\0" * 48
        nl.send(_diag_req(socket.AF_INET, socket.IPPROTO_TCP, _TCP_ALL_BUT_LISTEN, empty_id,
                          _NLM_F_REQUEST | _NLM_F_DUMP, _SOCK_DIAG_BY_FAMILY, 1))
        done = False
        while not done:
            data = nl.recv(65536)
            off = 0
            while off + 16 <= len(data):
                length, mtype = struct.unpack_from("=IH", data, off)
                if mtype in (_NLMSG_DONE, _NLMSG_ERROR):
                    done = True
                    break
                # struct inet_diag_msg: family, state, timer, retrans, then inet_diag_sockid (48 bytes)
                sock_id = data[off + 20: off + 20 + 48]
                dport = struct.unpack_from(">H", sock_id, 2)[0]
                dst = socket.inet_ntoa(sock_id[20:24])
                out.append((sock_id, dst, dport))
                off += (length + 3) & ~3
    return out


def destroy_sockets(keep: Callable[[str, int], bool]) -> int:
    """SOCK_DESTROY every TCP socket of this thread's netns whose peer ``keep`` refuses.

    The owner sees ECONNABORTED at once, whether it was sending or blocked reading.
    Returns how many were cut. Call it through :func:`in_netns`.
    """
    cut = 0
    victims = [(sid, dst, port) for sid, dst, port in _tcp_sockets()
               if not ipaddress.ip_address(dst).is_loopback and not keep(dst, port)]
    if not victims:
        return 0
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        for seq, (sock_id, _dst, _port) in enumerate(victims, start=2):
            nl.send(_diag_req(socket.AF_INET, socket.IPPROTO_TCP, _TCP_ALL_BUT_LISTEN, sock_id,
                              _NLM_F_REQUEST | _NLM_F_ACK, _SOCK_DESTROY, seq))
            reply = nl.recv(4096)
            if len(reply) >= 20 and struct.unpack_from("=H", reply, 4)[0] == _NLMSG_ERROR:
                err = -struct.unpack_from("=i", reply, 16)[0]
                if err == 0:
                    cut += 1
    return cut


def write_sysctls(values: Iterable[tuple[str, str]]) -> None:
    """Write net sysctls of this thread's netns (``/proc/sys/net/...`` follows the writer's netns)."""
    for key, value in values:
        with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
            f.write(value)
