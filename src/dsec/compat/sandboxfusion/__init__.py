"""SandboxFusion's HTTP API on DSec: verl, SkyRL and the ``sandbox-fusion`` client unchanged.

- ``models.py``: the request/response bodies (the wire contract);
- ``languages.py``: language -> toolchain image and commands;
- ``service.py``: one sandbox per call, through a window that absorbs backpressure;
- ``routes.py``: the routes the control plane mounts (``install``);
- ``jupyter_driver.py``, ``helpers.py``: programs written into the sandboxes.

docs/COMPAT.md, "SandboxFusion".
"""

from dsec.compat.sandboxfusion.config import SandboxFusionConfig

__all__ = ["SandboxFusionConfig"]
