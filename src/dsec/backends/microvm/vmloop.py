"""The microVM backend's own event loop, on a thread of its own.

Every conversation with a VM (QMP, the guest agent's stream, the bridges between callers'
fds and the agent's channels) runs on this loop. The backend's async methods hand their
work to it and await the answer; the synchronous ``Files`` object does the same from any
other thread. So a caller whose loop is busy, or not running at all between calls (a test
harness, the edge's worker threads for file calls), never stalls a VM's streams, and no
agent connection is bound to a loop that may go away.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from dsec.errors import HostError

T = TypeVar("T")


class VmLoop:
    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.loop is not None:
            return
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self.loop = loop
            asyncio.set_event_loop(loop)
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name=f"dsec-vm-{self.name}", daemon=True)
        self._thread.start()
        ready.wait()

    def stop(self) -> None:
        loop, thread = self.loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self.loop = None
        self._thread = None

    def on_loop(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self.loop is None:
            coro.close()
            raise HostError(f"the microvm backend {self.name} is not started")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the VM loop and await it from the caller's loop (a cancelled caller
        cancels it there)."""
        if self.on_loop():
            return await coro
        fut = self.submit(coro)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            raise

    def call_sync(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the VM loop from a thread that is not it, and wait for it."""
        if self.on_loop():
            coro.close()
            raise HostError("a synchronous microVM call was made on the VM loop itself (it would wait for itself)")
        return self.submit(coro).result(timeout)
