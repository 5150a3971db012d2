"""Function calls from the SDK: ``await client.fncall(image, source, args=...)`` and ``fncall_many``.

A call runs ``source`` in a fresh fork of a warm, pre-imported Python template on an edge
(docs/FNCALL.md): its JSON result, or a typed :class:`~dsec.spec.fncall.FnCallFailed`
(``FnCallError`` with the traceback, ``FnCallTimeout``, ``FnCallOOM``,
``FnCallOutputTooLarge``, ``FnCallWorkerLost``). :class:`AsyncClient` gets the methods from
:class:`FnCalls` (a mixin); the sync ``Client`` derives them as for every other method.

The client asks its URL once per image for a lease (``POST /v1/fncall/lease``: the control
plane picks an edge that runs the fncall backend, preferring one holding the image, and
mints a ``fncall`` token; an edge answers with itself), then sends calls straight to that
edge until the lease nears its end. A lease whose edge refuses the token or cannot be
reached is dropped and asked for again, once per call. Imports nothing heavy (the result
types are plain dataclasses).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from dsec.sdk._http import UNSET, _Unset, raise_for_error
from dsec.spec.fncall import FnCall, FnCallFailed, FnOutcome, FnResult, outcome_from_wire

if TYPE_CHECKING:
    from dsec.sdk._http import Endpoint, Response
    from dsec.sdk.failover import Replicas
    from dsec.spec import ImageRef

LEASE_MARGIN_S: Final = 60.0
"""A lease is renewed this long before it expires."""

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

    _http: Endpoint | Replicas

    def _edge(self, url: str) -> Endpoint:
        raise NotImplementedError  # AsyncClient's: pooled connections to an edge

    async def _fncall_lease(self, image: ImageRef | str, *, fresh: bool = False) -> tuple[Endpoint, str]:
        """(the edge to call, the token to call it with) for ``image``, leased from the client's URL."""
        leases: dict[str, tuple[float, Endpoint, str]] = self.__dict__.setdefault("_fncall_leases", {})
        key = json.dumps(_image(image), sort_keys=True)
        hit = leases.get(key)
        if hit is not None and not fresh and hit[0] - LEASE_MARGIN_S > time.time():
            return hit[1], hit[2]
        resp = await self._http.request("POST", "/v1/fncall/lease", content=_encode({"image": _image(image)}),
                                        headers=_JSON, idempotent=True)
        raise_for_error(resp)
        got = json.loads(resp.content)
        edge = self._edge(str(got["edge_url"]))
        leases[key] = (float(got["expires_at"]), edge, str(got["token"]))
        return edge, str(got["token"])

    async def _fncall_post(self, image: ImageRef | str, path: str, body: bytes, timeout: float | None) -> Response:
        """POST to the leased edge; a refused token or an unreachable edge gets a new lease once
        (a call never sent is safe to send again; one that reached a worker is not resent)."""
        import httpx

        for attempt in (0, 1):
            edge, token = await self._fncall_lease(image, fresh=attempt == 1)
            try:
                resp = await edge.request("POST", path, content=body, timeout=timeout, idempotent=False,
                                          headers={**_JSON, "authorization": f"Bearer {token}"})
            except (httpx.ConnectError, ConnectionRefusedError) as exc:
                if attempt:
                    raise
                last: BaseException = exc
                continue
            if resp.status_code in (401, 403) and not attempt:
                continue
            return resp
        raise AssertionError(f"unreachable: {last!r}")

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
        resp = await self._fncall_post(image, "/v1/fncall", _encode(body), http_timeout)
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
        resp = await self._fncall_post(image, "/v1/fncall/batch", _encode(body), http_timeout)
        raise_for_error(resp)
        return [outcome_from_wire(d) for d in json.loads(resp.content)["results"]]
