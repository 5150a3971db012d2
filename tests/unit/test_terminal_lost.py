"""A terminal whose command the backend loses (a VM that goes away with a named terminal still
attached to its pty): the terminal ends, with no status and the reason, for every client, and
its fds are closed; before, its watcher died with the backend's error ("Task exception was
never retrieved") and the terminal stayed open forever."""

from __future__ import annotations

import asyncio
import os

from dsec.edge.terminals import Terminal
from dsec.errors import HostError


class _Lost:
    pid = 4242

    def __init__(self) -> None:
        self.exited: asyncio.Future[object] = asyncio.get_running_loop().create_future()

    def kill(self, *, tree: bool = True) -> None:
        return None


def test_a_command_the_backend_lost_ends_its_terminal() -> None:
    async def go() -> None:
        master, slave = os.openpty()
        proc = _Lost()
        ended: list[Terminal] = []
        t = Terminal("vm-1", "work", ["/bin/sh"], proc, master=master, on_end=ended.append)  # type: ignore[arg-type]
        t.start()
        client = t.attach()
        proc.exited.set_exception(HostError("sandbox vm-1: the agent connection was closed"))
        os.close(slave)
        await asyncio.wait_for(t.ended.wait(), 5)
        assert t.exit is not None and t.exit["exit_code"] is None and t.exit["signal"] is None
        assert "agent connection was closed" in t.exit["lost"]
        assert ended == [t]
        items = [await asyncio.wait_for(client.get(), 1) for _ in range(2)]
        assert items == [{"exit": t.exit}, None]
        try:
            os.fstat(master)
            raise AssertionError("the terminal's master is still open")
        except OSError:
            pass

    asyncio.run(go())
