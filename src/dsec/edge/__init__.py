"""The edge agent: one per node, the final say on admission, and the data path.

``EdgeConfig`` is plain data; the server side (FastAPI, uvicorn, the runtime)
is imported only when ``create_app``/``serve_edge``/``EdgeService`` is used.
See docs/EDGE.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dsec.edge.config import EdgeConfig, PoolConfig

if TYPE_CHECKING:
    from dsec.edge.app import create_app
    from dsec.edge.server import ServerHandle, serve_edge
    from dsec.edge.service import EdgeService

__all__ = ["EdgeConfig", "EdgeService", "PoolConfig", "ServerHandle", "create_app", "serve_edge"]

_LAZY = {
    "create_app": "dsec.edge.app",
    "serve_edge": "dsec.edge.server",
    "ServerHandle": "dsec.edge.server",
    "EdgeService": "dsec.edge.service",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dsec.edge' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
