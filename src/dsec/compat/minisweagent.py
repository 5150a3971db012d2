"""A mini-swe-agent environment on DSec: ``DSecEnvironment`` (mini-swe-agent 2.4.6).

mini-swe-agent loads environments by import path; in its YAML config::

    environment:
      environment_class: dsec.compat.minisweagent.DSecEnvironment
      image: swe-debian:bookworm       # a DSec layer ref (dsec image build / import)
      cwd: /testbed
      timeout: 60

It behaves as mini-swe-agent's ``DockerEnvironment``: every action runs in a fresh
``bash -lc`` (no state carries over but the files), stderr folded into stdout, ``cwd`` and
``env``/``forward_env`` per command, a timeout answered with ``returncode -1`` and the
exception in ``exception_info``, and ``Submitted`` raised when the output starts with
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``. The sandbox is created when the environment is
(``dsec.Client``: $DSEC_URL, $DSEC_TOKEN) and deleted by :meth:`DSecEnvironment.cleanup`;
mini-swe-agent's runners never call it and let the object go (DockerEnvironment stops its
container from ``__del__``), so a finalizer deletes it then too, and the sandbox's TTL
(``ttl_s``, like Docker's ``container_timeout``) bounds it whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import platform
import weakref
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel, ConfigDict, Field

from dsec.compat._room import create_with_room_sync
from dsec.errors import DsecError, ExecTimeout
from dsec.sdk.sync import Client, Sandbox
from dsec.spec import ImageRef, NetworkPolicy, Resources, SandboxSpec

__all__ = ["DSecEnvironment", "DSecEnvironmentConfig"]


class DSecEnvironmentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    image: str = ""
    """A DSec layer ref (``name:tag``) for the sandbox's base."""
    workspace: str | None = None
    cwd: str = "/"
    """Working directory in which to execute commands."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set for every command."""
    forward_env: list[str] = Field(default_factory=list)
    """Variables of this process passed on when set (``env`` wins on a conflict)."""
    timeout: int = 30
    """Seconds a command may run."""
    interpreter: list[str] = Field(default_factory=lambda: ["bash", "-lc"])
    """What runs the action's command (it is the last argument), as DockerEnvironment's."""
    resources: dict[str, Any] = Field(default_factory=dict)
    """``dsec.Resources`` fields (``cpu``, ``memory``, ``disk``... in cores and bytes)."""
    allow: list[str] = Field(default_factory=list)
    """Named network permissions of the edge (e.g. ``pkgs``); none: loopback only."""
    spec: dict[str, Any] | None = None
    """A whole ``dsec.SandboxSpec`` instead of ``image``/``resources``/``allow``."""
    sandbox_id: str | None = None
    """Use this running sandbox (left running by ``cleanup``) instead of creating one."""
    url: str | None = None
    token: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    task: str | None = None
    ttl_s: float = 7200.0
    """The sandbox ends after this long whatever happens (DockerEnvironment's 2 h ``sleep``)."""
    output_cap: int = 4 << 20
    """Bytes kept of a command's output (the head and the tail)."""
    startup_timeout: float = 180.0
    """Seconds to wait for room while the cluster answers Backpressure."""

    def sandbox_spec(self) -> SandboxSpec:
        if self.spec is not None:
            return SandboxSpec.model_validate(self.spec)
        if not self.image:
            raise ValueError("DSecEnvironment: give an image (a DSec layer ref), a spec or a sandbox_id")
        return SandboxSpec(image=ImageRef(base=self.image, workspace=self.workspace),
                           resources=Resources(**self.resources),
                           network=NetworkPolicy(allow=tuple(self.allow)) if self.allow else None)


def _release(client: Client, sandbox: Sandbox | None, delete: bool) -> None:
    with contextlib.suppress(Exception):
        if sandbox is not None and delete:
            sandbox.close()
    with contextlib.suppress(Exception):
        client.close()


class DSecEnvironment:
    """mini-swe-agent's ``Environment`` protocol over one DSec sandbox (keyword arguments:
    :class:`DSecEnvironmentConfig`)."""

    def __init__(self, *, config_class: type = DSecEnvironmentConfig, **kwargs: Any) -> None:
        self.config = config_class(**kwargs)
        cfg = self.config
        self.client = Client(cfg.url, cfg.token)
        try:
            if cfg.sandbox_id is not None:
                self.sandbox = self.client.connect(cfg.sandbox_id)
            else:
                self.sandbox = create_with_room_sync(self.client, cfg.sandbox_spec(), timeout=cfg.startup_timeout,
                                                     labels={"minisweagent": "1", **cfg.labels}, task=cfg.task,
                                                     ttl_s=cfg.ttl_s)
        except BaseException:
            self.client.close()
            raise
        self._finalizer = weakref.finalize(self, _release, self.client, self.sandbox, cfg.sandbox_id is None)

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]``; the output dict mini-swe-agent's agents read."""
        command = action.get("command", "")
        env = {k: v for k in self.config.forward_env if (v := os.getenv(k)) is not None}
        env.update(self.config.env)
        argv = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *self.config.interpreter, command]
        try:
            res = self.sandbox.exec(argv, cwd=cwd or self.config.cwd, env=env,
                                    timeout=timeout or self.config.timeout, output_cap=self.config.output_cap)
            output: dict[str, Any] = {
                "output": res.stdout.decode("utf-8", errors="replace"),
                "returncode": res.exit_code if res.exit_code is not None else -(res.signal or 0),
                "exception_info": "",
            }
        except (DsecError, OSError) as e:
            partial = getattr(e, "result", None) if isinstance(e, ExecTimeout) else None
            output = {
                "output": partial.stdout.decode("utf-8", errors="replace") if partial is not None else "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        """Raises Submitted if the output indicates task completion."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        merged: dict[str, Any] = recursive_merge(self.config.model_dump(), platform.uname()._asdict(),
                                                 {"sandbox_id": self.sandbox.id}, kwargs)
        return merged

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json", exclude={"token"}),
            "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
        }}}

    def cleanup(self) -> None:
        """Delete the sandbox (one given by ``sandbox_id`` is left running) and close the client."""
        self._finalizer()
