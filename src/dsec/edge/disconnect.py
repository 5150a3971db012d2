"""Await a request's work, but not for a client that has gone."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def unless_disconnected(receive: Callable[[], Awaitable[Any]], work: Coroutine[Any, Any, T]) -> T | None:
    """Await ``work``, cancelling it if the client goes away first (for exec: the command's
    process tree is killed rather than left running for a caller who gave up). ``receive``:
    the request's, its body already read."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        left = not task.done()
        if left:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    return None if left else task.result()  # None: the client left, nobody reads the answer


__all__ = ["unless_disconnected"]
