"""Hot routes answered below FastAPI's routing and dependency machinery.

Measured on the create path (docs/PERFORMANCE.md, "Service"): FastAPI's
middleware stack, route matching over every route, dependency solving and
its body handling cost 0.4-0.5 ms per request on each of the control plane
and the edge, about as much as everything else the control plane does for a
create. The few routes on every rollout step (create, exec) are served here
instead: an exact method and path shape, the body read once, parsed by
pydantic's JSON parser and validated as FastAPI validates it, the same handler
code the FastAPI route runs, the same error answers.

A request the fast route does not fully understand (another content type or
none, a query string, a path that does not match exactly) goes on to FastAPI
unchanged, and the FastAPI routes stay as they are: they answer those
requests and document the API (OpenAPI). So does a body that is not JSON to
pydantic's parser: FastAPI gets the same bytes and gives its own answer
(Python's parser takes a few documents this one does not: a byte-order mark,
UTF-16, lone surrogates). Otherwise the fast route keeps FastAPI's order: the
body parsed, then the handler's authentication, then the body validated
(:meth:`FastRequest.model`, python mode on the parsed JSON, as FastAPI
validates a body parameter). Headers are read as Starlette reads them: the
first of a repeated header counts. Installed inside the app's body limit
(``BodyLimit``), so a body is refused at the same size on both paths; errors
come out through the app's own error functions. Never blocks the event loop:
handlers are the routes' async functions.

tests/integration/test_fastroute_parity.py sends every bad input both ways
and compares the answers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

JSON = b"application/json"
M = TypeVar("M", bound=BaseModel)
_NOT_JSON = object()


@dataclass(frozen=True, slots=True)
class FastRequest:
    headers: Mapping[bytes, bytes]
    """Lower-case names; of a repeated header, the first (as Starlette's ``headers.get``)."""
    params: tuple[str, ...]
    """The path's ``{...}`` segments, in order."""
    json: Any
    """The body, parsed and not yet validated (:meth:`model`)."""
    receive: Callable[[], Awaitable[Any]]
    """The request's ASGI receive (after the body: tells when the client goes away)."""

    def model(self, cls: type[M]) -> M:
        """The body as ``cls``, validated as FastAPI validates a body parameter; the wrong
        shape raises RequestValidationError with FastAPI's ``loc`` (``("body", ...)``). Call
        it after authenticating: FastAPI solves the dependencies before the body's model."""
        try:
            return cls.model_validate(self.json, from_attributes=True)  # FastAPI's call
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
            raise RequestValidationError(errors, body=self.json) from None

    def bearer(self) -> str | None:
        """The bearer token as FastAPI's ``HTTPBearer(auto_error=False)`` reads it (None: none)."""
        scheme, _, token = self.headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        token = token.strip()
        return token if token and scheme.lower() == "bearer" else None


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()


Handler = Callable[[FastRequest], Awaitable[Answer]]
ErrorRenderer = Callable[[Exception], Answer | None]
"""The app's exception handlers as one function: the answer its FastAPI route would give for
this exception (a DsecError, a RequestValidationError...), or None to let it propagate (as
to the app's catch-all 500)."""


class FastRoutes:
    """ASGI middleware: ``routes`` maps (method, path shape) to a handler. A shape is a path
    with ``{}`` for each parameter segment, e.g. ``/v1/sandboxes/{}/exec``."""

    def __init__(self, app: Any, *, routes: Mapping[tuple[str, str], Handler], errors: ErrorRenderer) -> None:
        self.app = app
        self.errors = errors
        self._by_len: dict[tuple[str, int], list[tuple[tuple[str | None, ...], Handler]]] = {}
        for (method, shape), handler in routes.items():
            assert shape.startswith("/") and not shape.endswith("/"), shape
            parts = tuple(None if p == "{}" else p for p in shape[1:].split("/"))
            self._by_len.setdefault((method, len(parts)), []).append((parts, handler))

    def _match(self, method: str, path: str) -> tuple[Handler, tuple[str, ...]] | None:
        # exact: no trailing slash (FastAPI redirects those), no empty segment
        if not path.startswith("/"):
            return None
        segs = path[1:].split("/")
        for parts, handler in self._by_len.get((method, len(segs)), ()):
            params: list[str] = []
            for want, got in zip(parts, segs, strict=True):
                if not got or (want is not None and want != got):
                    break
                if want is None:
                    params.append(got)
            else:
                return handler, tuple(params)
        return None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        hit = None
        if scope["type"] == "http" and not scope.get("query_string"):
            hit = self._match(scope["method"], scope["path"])
        if hit is None:
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value)
        if headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower() != JSON:
            await self.app(scope, receive, send)  # FastAPI refuses a body without a JSON type
            return
        handler, params = hit
        try:
            body = await _read(receive)
        except Exception as exc:  # over the body limit (BodyLimit's receive raises)
            await _send(send, self._render(exc))
            return
        if body is None:
            return  # the client left during the body: nobody to answer
        try:
            data = from_json(body)
        except ValueError:
            data = _NOT_JSON
        if data is _NOT_JSON:
            await self.app(scope, _replay(body, receive), send)
            return
        try:
            answer = await handler(FastRequest(headers, params, data, receive))
        except Exception as exc:
            answer = self._render(exc)
        await _send(send, answer)

    def _render(self, exc: Exception) -> Answer:
        answer = self.errors(exc)
        if answer is None:
            raise exc
        return answer


def answer_of(response: Any) -> Answer:
    """A Starlette response made by an app's error function, as an :class:`Answer`."""
    skip = (b"content-type", b"content-length")
    return Answer(response.status_code, bytes(response.body),
                  tuple((k, v) for k, v in response.raw_headers if k not in skip))


async def _send(send: Any, answer: Answer) -> None:
    await send({"type": "http.response.start", "status": answer.status, "headers": [
        (b"content-type", JSON), (b"content-length", b"%d" % len(answer.body)), *answer.headers,
    ]})
    await send({"type": "http.response.body", "body": answer.body})


async def _read(receive: Any) -> bytes | None:
    """The whole body, or None if the client went away first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Callable[[], Awaitable[Any]]:
    """``receive`` for an app that reads the body again: first the body, then the request's."""
    sent = False

    async def replayed() -> Any:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
