"""The spawner's wire: a request that does not fit is refused with EINVAL, never truncated."""

from __future__ import annotations

import errno
import os

import pytest

from conftest import RuntimeHarness
from dsec.backends.container.spawner import SpawnError
from dsec.errors import InvalidSpec

pytestmark = pytest.mark.root


def _refused(h: RuntimeHarness, op: str, fields: list[tuple[str, str]], fds: list[int] | None = None) -> SpawnError:
    async def go() -> SpawnError:
        spawner = await h.rt.ensure_spawner()
        with pytest.raises(SpawnError) as ei:
            await spawner.spawn(op, fields, fds or [])
        return ei.value

    return h.run(go())


def test_lists_over_their_cap_are_refused(rtx: RuntimeHarness) -> None:
    e = _refused(rtx, "create", [("lower", f"/nonexistent/l{i}") for i in range(16)])
    assert (e.stage, e.errno) == ("request", errno.EINVAL) and "at most 15 layers" in str(e), e
    e = _refused(rtx, "create", [("cg", f"/nonexistent/c{i}") for i in range(16)])
    assert (e.stage, e.errno) == ("request", errno.EINVAL), e
    # exec: the lists are checked before anything is started (4 fds: init pidfd + stdio).
    null = [os.open("/dev/null", os.O_RDWR) for _ in range(4)]
    try:
        fields = [("a", "/bin/true"), ("cwd", "/"), ("uid", "0"), ("gid", "0")]
        for key, n, what in (("lr", 256, "file rules"), ("pp", 72, "pristine paths"), ("rl", 32, "rlimits"),
                             ("pl", 16, "image layers"), ("cg", 16, "cgroups")):
            e = _refused(rtx, "exec", fields + [(key, f"x{i}") for i in range(n)], null)
            assert (e.stage, e.errno) == ("request", errno.EINVAL) and what in str(e), (key, e)
    finally:
        for fd in null:
            os.close(fd)
    # The spawner is still there and serves the next request.
    with rtx.sandbox() as rec:
        assert rtx.ok(rec.id, "echo fine").strip() == "fine"


def test_requests_too_big_for_the_wire_are_refused(rtx: RuntimeHarness) -> None:
    async def oversized() -> None:
        spawner = await rtx.rt.ensure_spawner()
        await spawner.spawn("create", [("pad", "x" * (600 * 1024))])

    with pytest.raises(InvalidSpec, match="request too large"):  # refused before it is sent
        rtx.run(oversized())
    e = _refused(rtx, "create", [("k", "v")] * 4200)  # 8,402 tokens: fits the bytes, not the token table
    assert (e.stage, e.errno) == ("request", errno.EINVAL) and "8192 tokens" in str(e), e
    with rtx.sandbox() as rec:
        assert rtx.ok(rec.id, "echo fine").strip() == "fine"
