"""The control channel of the FUSE process: JSON lines on a root-only unix socket.

One request per connection: the client writes one JSON object and a newline, the
server answers one JSON object and a newline, and closes. Requests::

    {"op": "ping"}                                   -> {"ok": true, "pid": N, "layers": K}
    {"op": "attach", "layer": {RemoteLayer}, "prefetch_metadata": true, "prefetch_all": false, "extents_of": ""}
                                                     -> {"ok": true, "path": ".../<hex>.erofs", "layer": {...stats}}
    {"op": "detach", "digest": "sha256:..."}         -> {"ok": true, "detached": bool}
    {"op": "stats"}                                  -> {"ok": true, "stats": {...}}
    {"op": "materialize", "digest": ..., "dest": PATH}-> {"ok": true, "path": PATH, "fetched_chunks": N}

A failure answers ``{"ok": false, "error": {"type": <class name>, "message", fields...}}``;
:func:`raise_for` turns it back into the class of :data:`.errors.ERRORS_BY_NAME`.
The client side (:func:`call`) is plain blocking sockets, for any caller, and imports
no async library; the server side (:mod:`.control_server`) runs on the FUSE
process's trio loop.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from dsec.errors import DsecError, InvalidSpec

from .errors import ERRORS_BY_NAME, LazyError, ServiceDown

log = logging.getLogger("dsec.images.lazy")

MAX_REQUEST = 64 << 20
"""A chunk table of a 100 GB layer at 1 MiB chunks is ~7 MB of JSON; leave room."""

def error_answer(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, DsecError):
        body = exc.to_wire()
        body.pop("code", None)
        name = type(exc).__name__ if type(exc).__name__ in ERRORS_BY_NAME else (
            "InvalidSpec" if isinstance(exc, InvalidSpec) else "LazyError"
        )
        return {"ok": False, "error": {"type": name, **body}}
    return {"ok": False, "error": {"type": "LazyError", "message": f"{type(exc).__name__}: {exc}"}}


def raise_for(answer: dict[str, Any]) -> dict[str, Any]:
    """Return ``answer`` when ok, else raise the error it carries."""
    if answer.get("ok"):
        return answer
    err = dict(answer.get("error") or {})
    name = str(err.pop("type", "LazyError"))
    message = str(err.pop("message", "the lazy layer service failed"))
    if name == "InvalidSpec":
        raise InvalidSpec(message, **err)
    raise ERRORS_BY_NAME.get(name, LazyError)(message, **err)


def call(path: Path, request: dict[str, Any], *, timeout_s: float = 60.0) -> dict[str, Any]:
    """Send one request to the FUSE process and return its (ok) answer; raise its error.
    Raises :class:`ServiceDown` when nothing listens on ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(timeout_s)
    try:
        try:
            s.connect(os.fspath(path))
        except OSError as exc:
            raise ServiceDown(
                f"the lazy layer service does not answer on {path}: {exc.strerror or exc}",
                socket=str(path),
            ) from exc
        s.sendall(json.dumps(request).encode() + b"\n")
        buf = bytearray()
        while b"\n" not in buf:
            try:
                data = s.recv(1 << 20)
            except TimeoutError as exc:
                raise ServiceDown(f"no answer from {path} within {timeout_s} s", socket=str(path)) from exc
            if not data:
                raise ServiceDown(f"{path} closed the connection without an answer", socket=str(path))
            buf += data
    finally:
        s.close()
    answer = json.loads(buf[: buf.index(b"\n")])
    if not isinstance(answer, dict):
        raise LazyError(f"malformed answer from {path}")
    return raise_for(answer)


__all__ = ["MAX_REQUEST", "call", "error_answer", "raise_for"]
