"""Function calls from the SDK: ``await client.fncall(image, source, args=...)`` and ``fncall_many``.

A call runs ``source`` in a fresh fork of a warm, pre-imported Python template on an edge
(docs/FNCALL.md): its JSON result, or a typed :class:`~dsec.backends.fncall.types.FnCallFailed`
(``FnCallError`` with the traceback, ``FnCallTimeout``, ``FnCallOOM``,
``FnCallOutputTooLarge``, ``FnCallWorkerLost``). :class:`AsyncClient` gets the methods from
:class:`FnCalls` (a mixin); the sync ``Client`` derives them as for every other method.

The request goes to the client's URL: an edge, with an ``edge-admin`` or ``fncall`` token.
Imports nothing heavy (the result types are plain dataclasses).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from dsec.backends.fncall.types import FnCall, FnCallFailed, FnOutcome, FnResult, outcome_from_wire
from dsec.sdk._http import UNSET, _Unset, raise_for_error

if TYPE_CHECKING:
    from dsec.sdk._http import Endpoint
    from dsec.spec import ImageRef

HTTP_MARGIN_S: Final = 30.0
"""The HTTP request waits this much longer than the call's own timeout (the edge answers a
timed-out call itself, with ``FnCallTimeout``)."""
_JSON: Final = {"content-type": "application/json"}


def _image(image: ImageRef | str) -> Any:
    return image if isinstance(image, str) else image.model_dump(mode="json", exclude_defaults=True)


def _limits(body: dict[str, Any], timeout: float | _Unset | None, memory: int | None,
            output_cap: int | None) -> float | None:
    """Put the limits the caller gave into ``body``; the HTTP timeout to use."""
    if not isinstance(timeout, _Unset):
        body["timeout"] = timeout
    if memory is not None:
        body["memory"] = memory
    if output_cap is not None:
        body["output_cap"] = output_cap
    if isinstance(timeout, _Unset):
        return 600.0 + HTTP_MARGIN_S  # the edge's default is far below; its ceiling, 300 s by default
    return None if timeout is None else timeout + HTTP_MARGIN_S


def _encode(body: dict[str, Any]) -> bytes:
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    except (TypeError, ValueError) as exc:
        from dsec.errors import InvalidSpec

        raise InvalidSpec(f"args and kwargs must be JSON values: {exc}", field="args") from None


class FnCalls:
    """The function-call methods of :class:`dsec.sdk.client.AsyncClient`."""

    _http: Endpoint

    async def fncall(self, image: ImageRef | str, source: str, *, args: Sequence[Any] = (),
                     kwargs: Mapping[str, Any] | None = None, entry: str | None = None,
                     timeout: float | _Unset | None = UNSET, memory: int | None = None,
                     output_cap: int | None = None) -> FnResult:
        """Run ``source`` on a warm worker of ``image`` and return its :class:`FnResult`.

        The source defines ``main(*args, **kwargs)`` (or the function ``entry`` names), whose
        return value is the result; without one, the value of its last expression. ``args``
        and ``kwargs`` are JSON values. ``timeout`` (seconds; left out: the edge's default,
        10 s; None: none, where the edge allows it), ``memory`` (bytes on top of the warm
        template) and ``output_cap`` (bytes of each of stdout, stderr and the result) bound
        it. Raises a :class:`FnCallFailed` when it does not return a value."""
        body: dict[str, Any] = {"image": _image(image), "source": source, "args": list(args),
                                "kwargs": dict(kwargs or {})}
        if entry is not None:
            body["entry"] = entry
        http_timeout = _limits(body, timeout, memory, output_cap)
        resp = await self._http.request("POST", "/v1/fncall", content=_encode(body), headers=_JSON,
                                        timeout=http_timeout, idempotent=False)
        raise_for_error(resp)
        out = outcome_from_wire(json.loads(resp.content))
        if isinstance(out, FnCallFailed):
            raise out
        return out

    async def fncall_many(self, image: ImageRef | str, calls: Sequence[FnCall | str], *,
                          timeout: float | _Unset | None = UNSET, memory: int | None = None,
                          output_cap: int | None = None) -> list[FnOutcome]:
        """Several calls on ``image`` in one request, run at once on the edge: one
        :class:`FnResult` or :class:`FnCallFailed` per call, in order (failures are returned,
        not raised). ``calls``: :class:`FnCall` items, or bare sources."""
        items = []
        for c in calls:
            c = FnCall(c) if isinstance(c, str) else c
            item: dict[str, Any] = {"source": c.source, "args": list(c.args), "kwargs": dict(c.kwargs)}
            if c.entry is not None:
                item["entry"] = c.entry
            items.append(item)
        body: dict[str, Any] = {"image": _image(image), "calls": items}
        http_timeout = _limits(body, timeout, memory, output_cap)
        resp = await self._http.request("POST", "/v1/fncall/batch", content=_encode(body), headers=_JSON,
                                        timeout=http_timeout, idempotent=False)
        raise_for_error(resp)
        return [outcome_from_wire(d) for d in json.loads(resp.content)["results"]]
