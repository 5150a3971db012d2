"""A Harbor environment on DSec: ``DSecEnvironment`` (harbor 0.26.0; Python >= 3.12).

Harbor loads environments by import path::

    harbor run -p tasks/my-task -a oracle \\
        --env dsec.compat.harbor:DSecEnvironment \\
        --ek image=my-task:latest --ek url=http://127.0.0.1:7070

Each trial's environment is one DSec sandbox (``dsec.AsyncClient``: ``url``/``token`` or
$DSEC_URL/$DSEC_TOKEN). DSec builds no Dockerfile: the sandbox starts from a DSec layer,
``image`` or else the task's ``[environment] docker_image`` read as a DSec layer ref (build
one with ``dsec image build``, e.g. ``--from-oci`` of a ``docker save`` of the task image).
Commands run as Harbor's Docker environment runs them (``bash -c``, the task's ``workdir``,
the trial's env, ``user``; a timeout raises ``RuntimeError("Command timed out after N
seconds")``); files move through DSec's files API (directories as tar). Resources come
from the task (``cpus``, ``memory_mb``, ``storage_mb``) or Harbor's overrides.

Network, per Harbor's policy: ``no-network`` is DSec's default (loopback only);
``allowlist`` of IPv4/IPv6 addresses and CIDRs becomes DSec rules (hostnames are refused,
as the capabilities say); ``public`` gets the edge's named permissions listed in
``allow`` (e.g. ``--ek allow='["internet"]'``) and, without any, loopback only (logged). A
phase's policy is switched on the live sandbox (``set_policy``).

Imports harbor: install it beside dsec in a Python 3.12+ environment
(``pip install harbor==0.26.0``); ``import dsec`` never imports this module.
"""

from __future__ import annotations

import asyncio
import io
import ipaddress
import tarfile
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult  # type: ignore[import-not-found]
from harbor.environments.capabilities import (  # type: ignore[import-not-found]
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.environments.options import EnvironmentOptions  # type: ignore[import-not-found]
from harbor.models.task.config import NetworkMode  # type: ignore[import-not-found]
from pydantic import Field

from dsec.compat._room import create_with_room
from dsec.errors import ExecTimeout, FileAccessError
from dsec.sdk.client import AsyncClient, AsyncSandbox
from dsec.spec import ImageRef, NetRule, Resources, SandboxSpec
from dsec.spec import NetworkPolicy as DsecNetworkPolicy

__all__ = ["DSecEnvironment", "DSecOptions"]

MiB = 1 << 20


class DSecOptions(EnvironmentOptions):  # type: ignore[misc]  # harbor's (untyped here)
    """``--ek`` options of :class:`DSecEnvironment`."""

    image: str | None = Field(default=None, description="DSec layer ref; default: the task's docker_image")
    url: str | None = Field(default=None, description="DSec control plane ($DSEC_URL)")
    token: str | None = Field(default=None, description="DSec API token ($DSEC_TOKEN)")
    allow: list[str] = Field(default_factory=list,
                             description="the edge's named network permissions given for network_mode=public")
    labels: dict[str, str] = Field(default_factory=dict)
    ttl_s: float = Field(default=7200.0, description="the sandbox ends after this long whatever happens")
    output_cap: int = Field(default=16 * MiB, ge=1024, le=64 * MiB,
                            description="bytes kept of each output stream of a command (head and tail)")
    startup_timeout: float = Field(default=600.0, description="seconds to wait for room while DSec is full")


class DSecEnvironment(BaseEnvironment):  # type: ignore[misc]  # harbor's (untyped here)
    """Harbor's ``BaseEnvironment`` over one DSec sandbox."""

    options_model = DSecOptions
    options: DSecOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._client: AsyncClient | None = None
        self._sandbox: AsyncSandbox | None = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "dsec"

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True, network_allowlist=True,
                                       network_allowlist_ipv4_addresses=True, network_allowlist_ipv6_addresses=True,
                                       network_allowlist_ipv4_cidrs=True, network_allowlist_ipv6_cidrs=True,
                                       dynamic_network_policy=True)

    @property
    def image(self) -> str | None:
        image: str | None = self.options.image or self.task_env_config.docker_image
        return image

    def _validate_definition(self) -> None:
        if not self.image:
            raise FileNotFoundError(
                "DSecEnvironment needs a DSec layer to start from: --ek image=NAME:TAG, or the task's "
                "[environment] docker_image naming one (DSec builds no Dockerfile; `dsec image build`)")

    @property
    def sandbox(self) -> AsyncSandbox:
        if self._sandbox is None:
            raise RuntimeError("the DSec sandbox is not started: call start() first")
        return self._sandbox

    # -- lifecycle --

    def _policy(self, policy: Any) -> DsecNetworkPolicy | None:
        mode = policy.network_mode
        if mode == NetworkMode.NO_NETWORK:
            return None
        if mode == NetworkMode.ALLOWLIST:
            rules = []
            for host in policy.allowed_hosts:
                try:
                    rules.append(NetRule(cidr=str(ipaddress.ip_network(host, strict=False)), protocol="any"))
                except ValueError:
                    raise ValueError(f"DSec allowlists take addresses and CIDRs, not hostnames ({host!r})") from None
            return DsecNetworkPolicy(rules=tuple(rules))
        if not self.options.allow:
            self.logger.warning("network_mode=public: no DSec permission given (--ek allow=[...]); the sandbox "
                                "reaches loopback only")
            return None
        return DsecNetworkPolicy(allow=tuple(self.options.allow))

    def _spec(self) -> SandboxSpec:
        res: dict[str, Any] = {}
        if (cpus := self._effective_cpus) is not None:
            res["cpu"] = float(cpus)
        if (memory := self._effective_memory_mb) is not None:
            res["memory"] = int(memory) * MiB
        if (storage := self._effective_storage_mb) is not None:
            res["disk"] = int(storage) * MiB
        assert self.image is not None  # _validate_definition
        return SandboxSpec(image=ImageRef(base=self.image), resources=Resources(**res),
                           network=self._policy(self._network_policy), output_cap=self.options.output_cap)

    async def start(self, force_build: bool) -> None:
        if force_build:
            self.logger.info("DSecEnvironment: force_build has no effect (the sandbox starts from a DSec layer)")
        self._client = AsyncClient(self.options.url, self.options.token)
        try:
            self._sandbox = await create_with_room(
                self._client, self._spec(), timeout=self.options.startup_timeout,
                labels={"harbor": "1", **self.options.labels}, ttl_s=self.options.ttl_s)
            self.logger.info(f"DSec sandbox {self._sandbox.id} for {self.session_id}")
            if self.task_env_config.workdir:  # a Dockerfile's WORKDIR exists; so does this one
                await self._sandbox.files.mkdir(self.task_env_config.workdir, parents=True)
            await self.ensure_dirs(self._mount_targets(writable_only=True))
            await self._upload_environment_dir_after_start()
        except BaseException:
            await self.stop(delete=True)
            raise

    async def stop(self, delete: bool) -> None:
        """Delete the sandbox (``delete``; else its TTL ends it) and close the client. Idempotent."""
        sandbox, client = self._sandbox, self._client
        self._sandbox = self._client = None
        try:
            if sandbox is not None and delete:
                await sandbox.close()
        finally:
            if client is not None:
                await client.aclose()

    async def _apply_network_policy(self, network_policy: Any) -> None:
        await self.sandbox.set_policy(self._policy(network_policy))

    # -- commands --

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        user = self._resolve_user(user)
        merged = {**(self.task_env_config.env or {}), **(self._merge_env(env) or {})}
        try:
            res = await self.sandbox.exec(["bash", "-c", command], cwd=cwd or self.task_env_config.workdir or "/",
                                          env=merged, user=0 if user is None else user,
                                          timeout=float(timeout_sec) if timeout_sec else None)
        except ExecTimeout:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from None
        return ExecResult(stdout=res.stdout.decode(errors="replace") or None,
                          stderr=res.stderr.decode(errors="replace") or None,
                          return_code=res.exit_code if res.exit_code is not None else 128 + (res.signal or 0))

    # -- files --

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        source = Path(source_path)
        data = await asyncio.to_thread(source.read_bytes)
        await self.sandbox.files.write(target_path, data, mode=source.stat().st_mode & 0o7777, parents=True)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        source = Path(source_dir)

        def pack() -> bytes:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                for child in sorted(source.iterdir()):
                    tar.add(str(child), arcname=child.name)
            return buf.getvalue()

        await self.sandbox.files.upload(target_dir, await asyncio.to_thread(pack))

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        try:
            data = await self.sandbox.files.read(source_path)
        except FileAccessError as exc:
            raise FileNotFoundError(str(exc)) from exc
        target = Path(target_path)

        def save() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

        await asyncio.to_thread(save)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        try:
            data = await self.sandbox.files.download(source_dir)
        except FileAccessError as exc:
            raise FileNotFoundError(str(exc)) from exc
        target = Path(target_dir)

        def unpack() -> None:
            target.mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:  # names relative to source_dir
                tar.extractall(target, filter="data")

        await asyncio.to_thread(unpack)
