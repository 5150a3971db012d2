"""A create as ``POST /v1/sandboxes`` makes it, checks included, for the routes and for
callers inside the control plane's process (the E2B front) that would otherwise call the
route over HTTP. Its own module: the front imports it without importing the app (which
imports the front)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsec.control import iam, validate
from dsec.spec.api import CreateBatch, CreateSandbox, SandboxInfo

if TYPE_CHECKING:
    from dsec.control.iam import Principal
    from dsec.control.service import Control


def check_create(body: CreateSandbox | CreateBatch) -> None:
    """What a create's body must be beyond its model: finite numbers, a short request id, a
    task name that is a name."""
    validate.finite(body.model_dump(mode="python"))
    validate.text(body.request_id, "request_id", max_len=128)
    if body.task is not None:
        iam.check_name(body.task, "task")


async def create_info(ctl: Control, who: Principal, body: CreateSandbox) -> SandboxInfo:
    """The create ``POST /v1/sandboxes`` makes: its checks, then the control plane's create."""
    check_create(body)
    return await ctl.sandboxes.create(who, body)


__all__ = ["check_create", "create_info"]
