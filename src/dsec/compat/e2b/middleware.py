"""Which requests are E2B's (the rules in front.py's docstring), in front of the control
plane's app. Imports nothing of E2B's until an E2B request comes (the control plane runs
without the ``compat`` extra; E2B's requests then get a 501 saying what to install)."""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse

from dsec.compat.e2b.scope import header as _header

if TYPE_CHECKING:
    from dsec.compat.e2b.config import E2BConfig

ENVD_PORT = 49983
_HOST = re.compile(r"^(\d+)-([A-Za-z0-9][A-Za-z0-9_-]{0,62})\.")  # ids have no dots: the first one ends it
REST_PREFIXES = ("/sandboxes", "/v2/sandboxes", "/templates", "/v2/templates", "/v3/templates")


def _json_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


class E2BMiddleware:
    """Route E2B's requests to the front, the rest to the app it wraps (control/app.py)."""

    def __init__(self, app: Any, config: E2BConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sid = _header(scope, b"e2b-sandbox-id")
        path = scope.get("path", "")
        port = ENVD_PORT
        plane = False
        if sid:
            plane = True
            with contextlib.suppress(ValueError):
                port = int(_header(scope, b"e2b-sandbox-port") or ENVD_PORT)
        else:
            m = _HOST.match(_header(scope, b"host") or "")
            if m:  # <port>-<id>.<domain>: what E2B's get_host(port) gives, with or without a token
                plane, port, sid = True, int(m.group(1)), m.group(2)
            elif (_header(scope, b"x-access-token") and not path.startswith("/v1/")) \
                    or (path == "/files" and b"signature=" in scope.get("query_string", b"")):
                plane = True  # a reconnected 2.7-2.26 client; a signed file URL
        if not plane and not path.startswith(REST_PREFIXES):
            await self.app(scope, receive, send)
            return
        try:
            front = await self._ensure(scope)
        except ImportError as exc:
            await _json_error(501, f"DSec's E2B front needs the released e2b package ({exc.name}): "
                                   "pip install 'dsec[compat]'")(scope, receive, send)
            return
        if front is None:
            await _json_error(503, "the E2B front is not started")(scope, receive, send)
            return
        if plane:
            await front.sandbox_plane(scope, receive, send, sid, port)
        else:
            await front.rest(scope, receive, send)

    async def _ensure(self, scope: dict[str, Any]) -> Any:
        from dsec.compat.e2b.front import E2BFront

        app = scope.get("app")
        state = getattr(app, "state", None)
        if state is None:
            return None
        front = getattr(state, "e2b", None)
        if front is None:
            ctl = getattr(state, "ctl", None)
            if ctl is None:
                return None
            front = E2BFront(self.config, ctl, lambda: getattr(state, "local_url", None) or "http://127.0.0.1:7070")
            state.e2b = front
            front.start()
        return front
