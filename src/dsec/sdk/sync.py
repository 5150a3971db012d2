"""The synchronous SDK, derived from the async one (never a second implementation).

Each sync class wraps its async twin; every public coroutine method becomes a
blocking method with the same signature, run on one background event loop per
:class:`Client`; async generators become iterators. ``tests/unit/test_sdk.py``
checks that both expose the same methods and signatures.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from dsec.sdk.client import AsyncClient, AsyncFiles, AsyncSandbox, AsyncSession
from dsec.sdk.leases import AsyncLease
from dsec.sdk.terminal import AsyncTerminal

T = TypeVar("T")


class _Portal:
    """A private event loop in a daemon thread; sync calls hop onto it.

    Stopping it is what ``asyncio.run`` does on the way out: async generators still open
    (an iterator the caller left unfinished) are closed on the loop, leftover tasks are
    cancelled and awaited, then the loop stops and is closed. Left to the garbage
    collector, their clean-up would be scheduled on a stopped loop ("Task was destroyed
    but it is pending! ... async_generator_athrow" at exit)."""

    def __init__(self) -> None:
        self._open: weakref.WeakSet[Any] = weakref.WeakSet()  # generators behind live iterators
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="dsec-sdk-loop", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T] | Any) -> Any:
        if not self.loop.is_running():
            coro.close()
            raise RuntimeError("the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        self._open.add(agen)
        try:
            while True:
                try:
                    yield self.call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None and self.loop.is_running():  # else stop() closed it already
                self.call(aclose())

    async def _wind_down(self) -> None:
        for agen in list(self._open):  # outermost first: each closes what it opened, in order
            with contextlib.suppress(Exception):
                await agen.aclose()
        await self.loop.shutdown_asyncgens()
        me = asyncio.current_task()
        left = [t for t in asyncio.all_tasks(self.loop) if t is not me]
        for t in left:
            t.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    def stop(self) -> None:
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._wind_down(), self.loop).result(timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self.loop.close()


_WRAPPERS: dict[type, type] = {}


def _wrap(portal: _Portal, value: Any) -> Any:
    cls = _WRAPPERS.get(type(value))
    if cls is not None:
        return cls(portal, value)
    if isinstance(value, list):
        return [_wrap(portal, v) for v in value]
    if hasattr(value, "sandbox") and type(getattr(value, "sandbox", None)) in _WRAPPERS:
        # CreateOutcome: swap in the sync sandbox.
        import dataclasses

        return dataclasses.replace(value, sandbox=_wrap(portal, value.sandbox))
    return value


def _derive(async_cls: type) -> Callable[[type], type]:
    """Class decorator: give the sync class a blocking twin of every public async method."""

    def decorate(sync_cls: type) -> type:
        for name, fn in inspect.getmembers(async_cls, predicate=inspect.isfunction):
            if name.startswith("_") or name in sync_cls.__dict__:
                continue
            if inspect.isasyncgenfunction(fn):
                def method(self: Any, *a: Any, _n: str = name, **kw: Any) -> Any:
                    agen = getattr(self._async, _n)(*a, **kw)
                    return (_wrap(self._portal, x) for x in self._portal.iterate(agen))
            elif inspect.iscoroutinefunction(fn):
                def method(self: Any, *a: Any, _n: str = name, **kw: Any) -> Any:
                    return _wrap(self._portal, self._portal.call(getattr(self._async, _n)(*a, **kw)))
            else:
                continue
            functools.update_wrapper(method, fn)
            method.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
            setattr(sync_cls, name, method)
        _WRAPPERS[async_cls] = sync_cls
        return sync_cls

    return decorate


class _SyncBase:
    def __init__(self, portal: _Portal, wrapped: Any) -> None:
        self._portal = portal
        self._async = wrapped

    def __getattr__(self, name: str) -> Any:
        # Plain attributes (id, info, ...) read through; methods are set by _derive.
        return getattr(self._async, name)


@_derive(AsyncFiles)
class Files(_SyncBase):
    """Blocking twin of :class:`AsyncFiles`."""


@_derive(AsyncSession)
class Session(_SyncBase):
    """Blocking twin of :class:`AsyncSession`."""

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@_derive(AsyncTerminal)
class Terminal(_SyncBase):
    """Blocking twin of :class:`AsyncTerminal`."""

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@_derive(AsyncSandbox)
class Sandbox(_SyncBase):
    """Blocking twin of :class:`AsyncSandbox`."""

    def __init__(self, portal: _Portal, wrapped: AsyncSandbox) -> None:
        super().__init__(portal, wrapped)
        self.files = Files(portal, wrapped.files)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Sandbox {self._async.id}>"


@_derive(AsyncLease)
class Lease(_SyncBase):
    """Blocking twin of :class:`dsec.sdk.leases.AsyncLease` (``with`` releases it)."""

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@_derive(AsyncClient)
class Client(_SyncBase):
    """Blocking twin of :class:`AsyncClient` (same arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        portal = _Portal()

        async def make() -> AsyncClient:
            return AsyncClient(*args, **kwargs)

        try:
            wrapped = portal.call(make())
        except BaseException:
            portal.stop()
            raise
        super().__init__(portal, wrapped)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close connections and the background loop. Idempotent."""
        if self._portal.loop.is_running():
            self._portal.call(self._async.aclose())
            self._portal.stop()
