"""Hot routes answered below FastAPI's routing and dependency machinery.

Measured on the create path (docs/PERFORMANCE.md, "Service"): FastAPI's
middleware stack, route matching over every route, dependency solving and
its body handling cost 0.4-0.5 ms per request on each of the control plane
and the edge, about as much as everything else the control plane does for a
create. The few routes on every rollout step (create, exec) are served here
instead: an exact method and path shape, the body read once and validated by
pydantic straight from the bytes, the same handler code the FastAPI route
runs, the same error answers.

A request the fast route does not fully understand (another content type, a
query string, a path that does not match exactly) goes on to FastAPI
unchanged, and the FastAPI routes stay as they are: they answer those
requests and document the API (OpenAPI). Installed inside the app's body
limit (``BodyLimit``), so a body is refused at the same size on both paths;
errors come out through the app's own error functions. Never blocks the event
loop: handlers are the routes' async functions.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from dsec.errors import AuthError, DsecError

JSON = b"application/json"


@dataclass(frozen=True, slots=True)
class FastRequest:
    headers: Mapping[bytes, bytes]
    params: tuple[str, ...]
    """The path's ``{...}`` segments, in order."""
    body: bytes
    receive: Callable[[], Awaitable[Any]]
    """The request's ASGI receive (after the body: tells when the client goes away)."""

    def bearer(self) -> str:
        """The bearer token, with the same refusal as FastAPI's HTTPBearer dependency."""
        header = self.headers.get(b"authorization", b"").decode("latin-1").strip()
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("missing credentials: send 'Authorization: Bearer <token>'")
        return token.strip()


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()


Handler = Callable[[FastRequest], Awaitable[Answer]]
ErrorRenderer = Callable[[Exception], Answer | None]
"""The app's answer for a DsecError or a pydantic ValidationError (None: not one of those)."""


class FastRoutes:
    """ASGI middleware: ``routes`` maps (method, path shape) to a handler. A shape is a path
    with ``{}`` for each parameter segment, e.g. ``/v1/sandboxes/{}/exec``."""

    def __init__(self, app: Any, *, routes: Mapping[tuple[str, str], Handler], errors: ErrorRenderer) -> None:
        self.app = app
        self.errors = errors
        self._by_len: dict[tuple[str, int], list[tuple[tuple[str | None, ...], Handler]]] = {}
        for (method, shape), handler in routes.items():
            parts = tuple(None if p == "{}" else p for p in shape.strip("/").split("/"))
            self._by_len.setdefault((method, len(parts)), []).append((parts, handler))

    def _match(self, method: str, path: str) -> tuple[Handler, tuple[str, ...]] | None:
        segs = path.strip("/").split("/")
        for parts, handler in self._by_len.get((method, len(segs)), ()):
            params: list[str] = []
            for want, got in zip(parts, segs, strict=True):
                if want is None:
                    if not got:
                        break
                    params.append(got)
                elif want != got:
                    break
            else:
                return handler, tuple(params)
        return None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("query_string"):
            await self.app(scope, receive, send)
            return
        hit = self._match(scope["method"], scope["path"])
        if hit is None:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        ctype = headers.get(b"content-type", JSON).split(b";", 1)[0].strip().lower()
        if ctype != JSON:
            await self.app(scope, receive, send)
            return
        handler, params = hit
        try:
            body = await _read(receive)
            answer = await handler(FastRequest(headers, params, body, receive))
        except (DsecError, ValidationError) as exc:
            rendered = self.errors(exc)
            if rendered is None:
                raise
            answer = rendered
        await send({"type": "http.response.start", "status": answer.status, "headers": [
            (b"content-type", JSON), (b"content-length", b"%d" % len(answer.body)), *answer.headers,
        ]})
        await send({"type": "http.response.body", "body": answer.body})


def answer_of(response: Any) -> Answer:
    """A Starlette response made by an app's error function, as an :class:`Answer`."""
    skip = (b"content-type", b"content-length")
    return Answer(response.status_code, bytes(response.body),
                  tuple((k, v) for k, v in response.raw_headers if k not in skip))


async def _read(receive: Any) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)
