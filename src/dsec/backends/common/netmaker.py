"""``dsec-netmaker``: the process that wires sandbox network namespaces.

Making a namespace with a veth, addresses, routes and the baseline nftables table
is ~10 ms of mostly pyroute2 Python. Done in the edge's own process it holds the
GIL against the event loop, and a create-heavy burst pays for the pool's refill
(measured: create with a policy 1.9x a plain create with the refill in-process,
1.07x without it). So a small helper process does it: the runtime sends
``{"ip", "ifname", "never"}`` (and, to wire a running sandbox, its namespace fd)
over a SOCK_SEQPACKET pair; the helper answers ``{"ok": true}`` with the new
namespace's fd, or ``{"ok": false, "error": ...}``. It holds no state: slots and
addresses are the runtime's. It dies with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any

from dsec.backends.common.netns import SlotTaken
from dsec.errors import HostError

_MAX = 64 * 1024


def _send(sock: socket.socket, msg: dict[str, Any], fd: int | None = None) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())] if fd is not None else []
    sock.sendmsg([json.dumps(msg).encode()], anc)


def _recv(sock: socket.socket) -> tuple[dict[str, Any] | None, int | None]:
    data, anc, _flags, _addr = sock.recvmsg(_MAX, socket.CMSG_SPACE(4))
    fd: int | None = None
    for level, typ, payload in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS and len(payload) >= 4:
            fd = int.from_bytes(payload[:4], sys.byteorder, signed=True)
    if not data:
        if fd is not None:
            os.close(fd)
        return None, None
    return json.loads(data), fd


class NetMaker:
    """The runtime's end: one request at a time (the caller serialises)."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self._proc = proc
        self._sock = sock
        self._lock = threading.Lock()

    @classmethod
    def start(cls) -> NetMaker:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dsec.backends.common.netmaker", str(child.fileno())],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, close_fds=True,
                start_new_session=True,
            )
        except OSError as exc:
            parent.close()
            raise HostError(f"cannot start the dsec-netmaker helper: {exc}") from exc
        finally:
            child.close()
        maker = cls(proc, parent)
        try:
            reply = maker._call({"op": "ping"}, None)[0]
        except HostError:
            maker.close()
            raise
        if not reply.get("ok"):
            maker.close()
            raise HostError(f"dsec-netmaker did not start: {reply.get('error')}")
        return maker

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def _call(self, msg: dict[str, Any], fd: int | None) -> tuple[dict[str, Any], int | None]:
        with self._lock:
            try:
                _send(self._sock, msg, fd)
                reply, got = _recv(self._sock)
            except OSError as exc:
                raise HostError(f"dsec-netmaker: {exc}") from exc
        if reply is None:
            raise HostError("dsec-netmaker exited; namespaces are made in-process from now on")
        return reply, got

    def make(self, slot: int, ip: str, ifname: str, never: str, into_fd: int | None = None) -> int:
        reply, fd = self._call({"op": "make", "slot": slot, "ip": ip, "ifname": ifname, "never": never,
                                "into": into_fd is not None}, into_fd)
        if not reply.get("ok") or fd is None:
            if fd is not None:
                os.close(fd)
            if reply.get("taken"):
                raise SlotTaken(str(reply.get("error")))
            raise HostError(str(reply.get("error") or "dsec-netmaker sent no namespace"))
        return fd

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def main(argv: list[str]) -> int:
    import ctypes

    from dsec.backends.common.netns import wire_netns

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: never outlive the runtime
    libc.prctl(15, b"dsec-netmaker")  # PR_SET_NAME
    sock = socket.socket(fileno=int(argv[0]))
    while True:
        try:
            req, fd = _recv(sock)
        except OSError:
            return 0
        if req is None:
            return 0  # the runtime closed its end
        try:
            if req.get("op") == "ping":
                _send(sock, {"ok": True})
                continue
            out = wire_netns(str(req["ip"]), str(req["ifname"]), str(req["never"]),
                             fd if req.get("into") else None)
            try:
                _send(sock, {"ok": True}, out)
            finally:
                os.close(out)
        except Exception as exc:
            with contextlib.suppress(OSError):
                _send(sock, {"ok": False, "error": str(exc), "taken": isinstance(exc, SlotTaken)})
        finally:
            if fd is not None:
                os.close(fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
