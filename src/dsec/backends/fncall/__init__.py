"""The FnCall backend: function calls served by warm, pre-imported Python workers.

``FnCallBackend`` (backend.py) is what an edge builds; ``FnCallPool`` (pool.py)
keeps the workers, which live as sandboxes of the container backend; the worker
program (worker.py) runs inside them and never imports dsec. docs/FNCALL.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsec.backends import BackendContext
    from dsec.backends.base import Backend
    from dsec.backends.fncall.config import FnCallConfig


def build_backend(config: FnCallConfig, ctx: BackendContext) -> Backend:
    """The FnCall backend ``config`` describes (not yet started; it runs its workers in the
    edge's container backend): :meth:`FnCallConfig.build`."""
    from dsec.backends.fncall.backend import FnCallBackend

    return FnCallBackend(config, name=ctx.name, ctx=ctx)
