"""Bounded capture of a command's output, and non-blocking writes to its input.

Keeps the first and the last ``cap`` bytes of a stream and counts the rest, so
a ``yes`` that runs until its timeout costs at most ``2 * cap`` bytes of host
memory per stream, never disk.
"""

from __future__ import annotations

from dsec.backends.fdio import set_done, write_all
from dsec.spec.results import ExecResult

__all__ = ["BoundedCapture", "ExecResult", "set_done", "write_all"]


class BoundedCapture:
    __slots__ = ("_head", "_tail", "cap", "total")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.total = 0
        self._head = bytearray()
        self._tail = bytearray()

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.cap - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data:
            self._tail += data
            if len(self._tail) > self.cap:
                del self._tail[: len(self._tail) - self.cap]

    @property
    def truncated(self) -> bool:
        return self.total > len(self._head) + len(self._tail)

    def value(self) -> bytes:
        if not self.truncated:
            return bytes(self._head + self._tail)
        dropped = self.total - len(self._head) - len(self._tail)
        marker = f"\n[... dsec: {dropped} bytes omitted ...]\n".encode()
        return bytes(self._head) + marker + bytes(self._tail)


