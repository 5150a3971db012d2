"""A "remote" host on this machine for benchmarks: a network namespace behind a shaped veth.

:class:`ShapedHost` makes a network namespace ``<name>`` joined to the host by a veth
pair, with ``tbf`` limiting the rate each way, so a server started inside it
(``ip netns exec``) is reached over a link of a stated bandwidth. This kernel has no
``netem`` (``CONFIG_NET_SCH_NETEM`` is unset, nor ``fq`` for an eBPF delay), so the
stated one-way delay comes from :mod:`dsec.bench.delayline`, a userspace delay line on
the host side of the link: clients connect to it, it connects through the veth.
Everything is named after ``name`` and removed on exit (deleting the namespace deletes
the veth).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dsec.errors import HostError

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,11}$")


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise HostError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}", command="ip")


@dataclass
class ShapedHost:
    """The namespace ``netns``; the host reaches it at ``remote_ip``, it the host at ``host_ip``."""

    netns: str
    host_if: str
    host_ip: str
    remote_ip: str
    rate: str

    def rx_bytes(self) -> int:
        """Bytes the host has received over the link (the remote host's sends)."""
        return int(Path(f"/sys/class/net/{self.host_if}/statistics/rx_bytes").read_text())

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]


@contextlib.contextmanager
def shaped_host(name: str, *, rate: str = "1gbit", subnet: int = 77) -> Iterator[ShapedHost]:
    """A namespace ``dsec-<name>`` behind a veth shaped to ``rate`` each way (tc tbf)."""
    if not _NAME.match(name):
        raise ValueError(f"bad shaped host name {name!r}")
    netns, host_if, peer = f"dsec-{name}", f"dsh{name}"[:15], f"dsr{name}"[:15]
    host_ip, remote_ip = f"10.253.{subnet}.1", f"10.253.{subnet}.2"
    with contextlib.suppress(HostError):
        _ip("netns", "del", netns)  # a crashed run's
    _ip("netns", "add", netns)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", peer, "netns", netns)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", netns, "addr", "add", f"{remote_ip}/30", "dev", peer)
        _ip("-n", netns, "link", "set", peer, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        for ns, dev in ((None, host_if), (netns, peer)):
            cmd = ["tc", *(["-n", ns] if ns else []), "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", "256kb", "latency", "50ms"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise HostError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}", command="tc")
        yield ShapedHost(netns, host_if, host_ip, remote_ip, rate)
    finally:
        with contextlib.suppress(HostError):
            _ip("netns", "del", netns)
        with contextlib.suppress(HostError):
            _ip("link", "del", host_if)


class DelayLine:
    """``python -m dsec.bench.delayline`` in its own process: listens on 127.0.0.1, forwards
    to ``target`` (host, port), every byte delayed by ``delay_ms`` each way."""

    def __init__(self, target: tuple[str, int], delay_ms: float) -> None:
        self.target = target
        self.delay_ms = delay_ms
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    def __enter__(self) -> DelayLine:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsec.bench.delayline", "--to", f"{self.target[0]}:{self.target[1]}",
             "--delay-ms", str(self.delay_ms)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 10
        line = self.proc.stdout.readline()
        if not line.startswith("listening ") or time.monotonic() > deadline:
            self.__exit__()
            raise HostError(f"the delay line did not start: {line!r}", command="delayline")
        self.port = int(line.split()[1])
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 15)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


__all__ = ["DelayLine", "ShapedHost", "shaped_host"]
