"""E2B's released clients (``e2b``, ``e2b-code-interpreter``) unchanged on DSec.

One listener, the control plane's, serves E2B's REST API and its sandbox plane:

- ``front.py``: the routing (E2b-Sandbox-Id header, access token, signed file URL, Host,
  REST paths) in front of the control plane's app, and envd's ``/files``;
- ``rest.py``: sandboxes (create v1/v2, get, list, kill, timeout, pause, connect), templates;
- ``envd.py``: envd's Connect services (Process, Filesystem) on the wheel's generated classes;
- ``interpreter.py`` + ``kernel_server.py``: code-interpreter's ``/execute`` and contexts;
- ``rooms.py``: per-sandbox handles and processes; ``keys.py``: API keys and access tokens.

docs/COMPAT.md, "E2B".
"""

from dsec.compat.e2b.config import E2BConfig, E2BTemplate

__all__ = ["E2BConfig", "E2BTemplate"]
