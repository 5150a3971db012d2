"""The FnCall backend: function calls served by warm, pre-imported Python workers.

``FnCallBackend`` (backend.py) is what an edge builds; ``FnCallPool`` (pool.py)
keeps the workers, which live as sandboxes of the container backend; the worker
program (worker.py) runs inside them and never imports dsec. docs/FNCALL.md.
"""
