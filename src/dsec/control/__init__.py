"""The control plane: IAM (nested projects, quotas, tokens), placement, the watcher, the store.

Stateless API replicas over one store (SQLite embedded by default, PostgreSQL
for several replicas); see docs/CONTROL.md. Server-side only: imported
lazily, never by ``import dsec``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsec.control.app import create_app
    from dsec.control.config import ControlConfig, PlacementConfig
    from dsec.control.server import ControlHandle, serve_control

__all__ = ["ControlConfig", "ControlHandle", "PlacementConfig", "create_app", "serve_control"]

_WHERE = {
    "create_app": "dsec.control.app",
    "ControlConfig": "dsec.control.config",
    "PlacementConfig": "dsec.control.config",
    "ControlHandle": "dsec.control.server",
    "serve_control": "dsec.control.server",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'dsec.control' has no attribute {name!r}")
