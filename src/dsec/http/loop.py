"""The event loop DSec's servers run on: uvloop when it is installed (the ``server`` extra).

Measured on the service path (docs/PERFORMANCE.md): the default selector loop spends
a large share of the control plane's and the edge's CPU in socket writes and in the
self-pipe wake-ups that carry store results back from worker threads; uvloop does
both in C. The SDK never imposes a loop on its caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - the server extra pins it
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the fastest loop available."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
