"""Adapters that let clients of other sandbox services run on DSec unchanged.

Each adapter speaks another project's wire protocol and maps it onto DSec's own
sandboxes (one per call, or one per session), so a user changes a URL or one line of
configuration, never their code:

- :mod:`dsec.compat.sandboxfusion`: SandboxFusion's HTTP API (``/run_code``,
  ``/run_jupyter``, ``/v1/ping``), served by the control plane under ``/sandboxfusion``
  (docs/COMPAT.md);
- :mod:`dsec.compat.swerex`: SWE-ReX's ``AbstractDeployment`` / ``AbstractRuntime``
  (``DSecDeployment``, ``DSecRuntime``) over DSec terminals, exec, sessions and files.

Adapters never run a caller's code outside a sandbox, and never bypass DSec's quotas or
admission: they are clients of the same API a user's SDK calls.
"""
