"""Adapters that let clients of other sandbox services run on DSec unchanged.

Each adapter speaks another project's wire protocol and maps it onto DSec's own
sandboxes (one per call, or one per session), so a user changes a URL or one line of
configuration, never their code:

- :mod:`dsec.compat.sandboxfusion`: SandboxFusion's HTTP API (``/run_code``,
  ``/run_jupyter``, ``/v1/ping``), served by the control plane under ``/sandboxfusion``
  (docs/COMPAT.md);
- :mod:`dsec.compat.swerex`: SWE-ReX's ``AbstractDeployment`` / ``AbstractRuntime``
  (``DSecDeployment``, ``DSecRuntime``) over DSec terminals, exec, sessions and files;
- :mod:`dsec.compat.minisweagent`: a mini-swe-agent environment class
  (``environment_class: dsec.compat.minisweagent.DSecEnvironment``);
- :mod:`dsec.compat.harbor`: a Harbor environment
  (``harbor run -e dsec.compat.harbor:DSecEnvironment``; Python >= 3.12).

The SWE-ReX, mini-swe-agent and Harbor modules import their projects (the ``compat``
extra; Harbor is installed on its own); nothing imports them unless asked.

Adapters never run a caller's code outside a sandbox, and never bypass DSec's quotas or
admission: they are clients of the same API a user's SDK calls.
"""
