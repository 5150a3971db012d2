"""End to end: SDK -> control plane -> edge -> runtime, all real, on loopback.

One all-in-one (`dsec.cli.up.start_cluster`) per module, with a busybox base
layer in the edge's store.
"""

from __future__ import annotations

import asyncio
import io
import shlex
import tarfile
import uuid
from collections.abc import Iterator
from typing import TypeVar

import httpx
import pytest

from conftest import ClusterHarness as Harness
from conftest import in_process_cluster
from dsec import Client, ExecResult, ImageRef, Resources, SandboxSpec
from dsec.errors import (
    AuthError,
    ExecTimeout,
    Forbidden,
    LayerNotFound,
    QuotaExceeded,
    SandboxNotFound,
)

pytestmark = pytest.mark.root
T = TypeVar("T")


@pytest.fixture(scope="module")
def svc() -> Iterator[Harness]:
    with in_process_cluster("dsec-test-e2e-") as h:
        yield h


SPEC = SandboxSpec(image=ImageRef(base="busybox:latest"), resources=Resources(cpu=0.5, memory=128 << 20, disk=32 << 20))


def test_round_trip_through_the_sdk(svc: Harness) -> None:
    async def go() -> None:
        async with svc.client() as c:
            async with await c.create(SPEC, labels={"suite": "e2e"}) as sb:
                assert sb.id.startswith("e1-")
                res = await sb.exec("echo hi; echo err >&2; exit 3")
                assert (res.exit_code, res.stdout, res.stderr) == (3, b"hi\n", b"err\n")
                assert (await sb.exec(["cat"], stdin=b"piped")).stdout == b"piped"
                await sb.files.write("/tmp/a.txt", "hello")
                await sb.files.append("/tmp/a.txt", " world")
                assert await sb.files.read_text("/tmp/a.txt") == "hello world"
                assert {e.name for e in await sb.files.list("/tmp")} >= {"a.txt"}
                buf = io.BytesIO()
                with tarfile.open(fileobj=buf, mode="w") as tar:
                    info = tarfile.TarInfo("pkg/x.py")
                    info.size = 3
                    tar.addfile(info, io.BytesIO(b"x=1"))
                assert await sb.files.upload("/src", buf.getvalue()) >= 1
                assert (await sb.exec("cat /src/pkg/x.py")).stdout == b"x=1"
                with tarfile.open(fileobj=io.BytesIO(await sb.files.download("/src"))) as tar:
                    names = tar.getnames()
                assert any(n.endswith("x.py") for n in names)
                async with await sb.session() as sess:
                    await sess.run("cd /tmp && export X=42")
                    r = await sess.run("pwd; echo $X")
                    assert r.stdout == b"/tmp\n42\n"
                chunks = [c async for c in sb.exec_stream("echo one; sleep 0.2; echo two")]
                assert b"".join(c.data for c in chunks[:-1] if hasattr(c, "data")) == b"one\ntwo\n"
                assert chunks[-1].exit_code == 0
                with pytest.raises(ExecTimeout) as ei:
                    await sb.exec("echo started; sleep 30", timeout=1)
                assert ei.value.result.stdout == b"started\n"
                sid = sb.id
            # Deleted: either gone from the store or kept as a tombstone in a final state.
            try:
                info = await c.info(sid)
                assert info.state.value in ("stopped", "stopping", "failed"), info
            except SandboxNotFound:
                pass

    svc.run(go())


def test_results_name_the_limit_that_ended_a_command(svc: Harness) -> None:
    hog = "x=$(head -c 400000000 /dev/zero | tr '\\0' a); echo ${#x}"  # 400 MB in a shell variable
    spec = SandboxSpec(image=ImageRef(base="busybox:latest"), resources=Resources(cpu=0.5, memory=64 << 20, pids=16))
    line = "dsec: killed by the memory limit (64 MiB): raise it with --memory / Resources.memory"

    async def go() -> None:
        async with svc.client() as c, await c.create(spec) as sb:
            res = await sb.exec(hog)
            assert res.signal == 9 and res.limit is not None, res
            assert (res.limit.kind, res.limit.value, res.limit.message) == ("memory", 64 << 20, line)
            streamed = [item async for item in sb.exec_stream(hog)]
            final = streamed[-1]
            assert isinstance(final, ExecResult) and final.limit is not None and final.limit.kind == "memory", final
            async with await sb.session() as sh:
                ran = await sh.run(f"sh -c {shlex.quote(hog)}")
                assert ran.exit_code == 137 and ran.limit is not None and ran.limit.kind == "memory", ran
            res = await sb.exec("i=0; while [ $i -lt 50 ]; do sleep 30 & i=$((i+1)); done")
            assert res.limit is not None and (res.limit.kind, res.limit.value) == ("pids", 16), res
            await sb.exec("killall -9 sleep")
            with pytest.raises(ExecTimeout) as ei:
                await sb.exec("sleep 30", timeout=0.5)
            hit = ei.value.result.limit
            assert hit is not None and (hit.kind, hit.value) == ("timeout", 0.5)
            assert (await sb.exec("exit 1")).limit is None

    svc.run(go())


def test_sync_client_against_the_real_service(svc: Harness) -> None:
    def blocking() -> None:
        with Client(svc.cluster.url, svc.cluster.admin_token) as c, c.create(SPEC) as sb:
            assert sb.exec("hostname").stdout.decode().strip() == sb.id
            sb.files.write("/tmp/s", b"sync")
            assert sb.files.read("/tmp/s") == b"sync"

    # The services run in the harness's event loop: drive the blocking client from a thread.
    svc.run(asyncio.to_thread(blocking))


def test_sandbox_cannot_reach_the_platform(svc: Harness) -> None:
    """Loopback inside is the sandbox's own: neither control plane, edge nor host answers."""
    cp_port = httpx.URL(svc.cluster.url).port
    edge_port = httpx.URL(svc.cluster.edges[0].url).port

    async def go() -> None:
        async with svc.client() as c, await c.create(SPEC) as sb:
            for port in (cp_port, edge_port):
                r = await sb.exec(f"wget -q -T 2 -O - http://127.0.0.1:{port}/healthz; echo rc=$?", timeout=20)
                assert b"rc=0" not in r.stdout, r
            r = await sb.exec("cat /proc/net/route | wc -l; ls /sys/class/net 2>/dev/null; ip route 2>&1; echo done")
            assert b"done" in r.stdout
            # No default route: only the header line of /proc/net/route.
            assert r.stdout.split(b"\n")[0].strip() == b"1"

    svc.run(go())


def test_tokens_are_scoped(svc: Harness) -> None:
    async def go() -> None:
        async with svc.client() as c:
            a = await c.create(SPEC)
            b = await c.create(SPEC)
            try:
                async with httpx.AsyncClient(base_url=a.info.edge_url) as http:
                    # a's token on b: forbidden
                    r = await http.post(f"/v1/sandboxes/{b.id}/exec", json={"cmd": ["true"]},
                                        headers={"authorization": f"Bearer {a.info.token}"})
                    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
                    r = await http.post(f"/v1/sandboxes/{b.id}/exec", json={"cmd": ["true"]})
                    assert r.status_code == 401
                    forged = a.info.token[:-4] + ("AAAA" if not a.info.token.endswith("AAAA") else "BBBB")
                    r = await http.post(f"/v1/sandboxes/{a.id}/exec", json={"cmd": ["true"]},
                                        headers={"authorization": f"Bearer {forged}"})
                    assert r.status_code == 401
            finally:
                await a.close()
                await b.close()
            with pytest.raises(AuthError):
                async with svc.client("dsk_" + "x" * 43) as bad:
                    await bad.list()

    svc.run(go())


def test_projects_quotas_and_visibility(svc: Harness) -> None:
    name = f"p{uuid.uuid4().hex[:8]}"

    async def go() -> None:
        async with svc.client() as admin:
            await admin.create_project(name, quota={"sandboxes": 2, "cpu": 4, "memory": 4 << 30})
            tok = await admin.create_token(project=name)
            assert tok.token
            async with svc.client(tok.token) as c:
                s1 = await c.create(SPEC)
                s2 = await c.create(SPEC)
                with pytest.raises(QuotaExceeded):
                    await c.create(SPEC)
                mine = {i.id for i in await c.list()}
                assert mine == {s1.id, s2.id}
                other = await admin.create(SPEC)
                try:
                    assert other.id not in {i.id for i in await c.list()}
                    with pytest.raises((SandboxNotFound, Forbidden)):
                        await c.connect(other.id)
                finally:
                    await other.close()
                await s1.close()
                await s2.close()
            await admin.revoke_token(tok.id)
            with pytest.raises(AuthError):
                async with svc.client(tok.token) as c:
                    await c.list()

    svc.run(go())


def test_create_many_idempotency_and_bad_input(svc: Harness) -> None:
    async def go() -> None:
        async with svc.client() as c:
            outs = [o async for o in c.create_many(SPEC, 20, concurrency=8, labels={"batch": "e2e"})]
            assert len(outs) == 20 and all(o.ok for o in outs), [o.error for o in outs if not o.ok]
            assert len({o.sandbox.id for o in outs if o.sandbox}) == 20
            assert await c.delete_where(labels={"batch": "e2e"}) == 20
            assert not await c.list(labels={"batch": "e2e"}, state="running")

            a = await c.create(SPEC, request_id="same-request")
            b = await c.create(SPEC, request_id="same-request")
            assert a.id == b.id
            await a.close()

            with pytest.raises(LayerNotFound):
                await c.create(SandboxSpec(image=ImageRef(base="no-such-image:1")))
        async with httpx.AsyncClient(base_url=svc.cluster.url) as http:
            r = await http.post("/v1/sandboxes", json={"spec": {"image": {"base": "busybox"}, "resources": {"memory": 1}}},
                                headers={"authorization": f"Bearer {svc.cluster.admin_token}"})
            assert r.status_code == 422
            assert "memory" in str(r.json()["error"].get("field", "")) + str(r.json()["error"])

    svc.run(go())
    with pytest.raises(ValueError, match="not a layer reference"):
        SandboxSpec(image=ImageRef(base="Bad Name"))
