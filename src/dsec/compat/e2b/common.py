"""What the E2B front's REST API and its template builds share: E2B's error shape, the
``user`` set-up a sandbox gets, times as E2B writes them, a request's JSON body. Its own
module so that the two import it, not each other."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request

from dsec.compat.e2b.rooms import USER_UID

USER_SETUP = (
    "u=; while IFS=: read -r n _; do [ \"$n\" = user ] && u=1; done < /etc/passwd; "
    "[ -n \"$u\" ] || echo 'user:x:1000:1000:user:/home/user:/bin/bash' >> /etc/passwd; "
    "g=; while IFS=: read -r n _; do [ \"$n\" = user ] && g=1; done < /etc/group; "
    "[ -n \"$g\" ] || echo 'user:x:1000:' >> /etc/group; "
    f"exec install -d -o {USER_UID} -g {USER_UID} /home/user"
)
"""Run as root once per create (and by a template build): E2B's ``user`` (uid 1000, home
/home/user). One process: the shell's builtins read and append, ``install`` replaces it (it was
five: grep twice, mkdir, chown, the shell; on 2 cores they competed with the client's own work
on the create's answer)."""


class E2BError(Exception):
    """An answer in E2B's error shape."""

    def __init__(self, status: int, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


async def _json_body(request: Request, *, allow_empty: bool = False) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        if allow_empty:
            return {}
        raise E2BError(400, "the request has no JSON body")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise E2BError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise E2BError(400, "the JSON body must be an object")
    return body


__all__ = ["USER_SETUP", "E2BError", "_json_body", "rfc3339"]
