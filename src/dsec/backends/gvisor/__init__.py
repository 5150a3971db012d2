"""The gVisor backend: sandboxes under runsc (docs/GVISOR.md).

Importing this package imports only the config (pure data). The backend itself,
:class:`dsec.backends.gvisor.backend.GVisorBackend`, is imported when an edge builds it::

    from dsec.backends.gvisor.backend import GVisorBackend
    backend = GVisorBackend(config, name=..., state_dir=..., run_dir=..., id_prefix=..., store=...)
"""

from __future__ import annotations

from dsec.backends.gvisor.config import GVisorConfig

__all__ = ["GVisorConfig"]
