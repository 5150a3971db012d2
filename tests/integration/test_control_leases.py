"""Create leases end to end: the SDK, a control plane (SQLite and PostgreSQL) and a real edge agent.

A grant charges the quota once and answers one signed token per edge part; the SDK sends
creates straight to the edge, which makes each sandbox under its slot's key and reports it;
the control plane records it into the slot's reservation. Checked here on the real services:
counters at every step (grant, report, release, expiry), what the edge refuses (another body,
used-up slots, revoked and expired leases, a lease token on a sandbox route), idempotent
resends, reports lost (a lookup by id records its sandbox at once, the watcher's reconcile
the others by their keys), and an API token's revocation ending its leases. docs/CONTROL.md, "Create leases".
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import test_control_support as support

from conftest import RT_PREFIX
from dsec.errors import HostError, LeaseInvalid, QuotaExceeded

pytestmark = [pytest.mark.root, pytest.mark.anyio]

anyio_backend = support.anyio_backend
db_url = support.db_url
pg_cluster = support.pg_cluster
KEY = secrets.token_bytes(32)
SPEC: dict[str, Any] = {"image": {"base": "busybox:test"}, "resources": {"cpu": 0.1, "memory": 32 << 20, "disk": 16 << 20}}


@pytest.fixture(scope="module")
def edge_state(dsec_base: Path) -> Iterator[tuple[Path, str]]:
    from dsec.edge.testing import prepare_busybox

    name = f"{RT_PREFIX}-lease"
    state = dsec_base / f"state-{name}"
    try:
        prepare_busybox(state)
    except HostError as exc:
        pytest.skip(f"cannot build the busybox layer: {exc}")
    yield state, name


class Stack:
    def __init__(self, ctl: Any, edge: Any) -> None:
        self.ctl = ctl
        self.edge = edge

    @property
    def control(self) -> Any:
        return self.ctl.control

    async def used(self, c: httpx.AsyncClient, project: str = "root") -> int:
        return int((await c.get(f"/v1/projects/{project}")).json()["used"]["sandboxes"])

    async def committed(self, c: httpx.AsyncClient) -> int:
        return int((await c.get("/v1/edges")).json()[0]["committed"]["sandboxes"])

    async def recorded(self, c: httpx.AsyncClient, n: int, **params: Any) -> list[dict[str, Any]]:
        """The sandboxes listed once ``n`` are (reports arrive off the create path)."""
        for _ in range(200):
            got = (await c.get("/v1/sandboxes", params=params)).json()
            if len(got) >= n:
                return list(got)
            await asyncio.sleep(0.05)
        raise AssertionError(f"{n} sandboxes never recorded: {got}")


@contextlib.asynccontextmanager
async def stack(edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path, db: str) -> AsyncIterator[Stack]:
    from dsec.control import ControlConfig, serve_control
    from dsec.edge.config import EdgeConfig
    from dsec.edge.testing import EdgeThread

    state, name = edge_state
    ctl = await serve_control(ControlConfig(
        data_dir=tmp_path / "control", database_url=db, cluster_key=KEY, port=0, watcher=False, auth_cache_s=0.0,
    ))
    cfg = EdgeConfig(
        edge_id="lx", cluster_key=KEY, port=0, state_dir=state, run_dir=dsec_base / "run", runtime_name=name,
        destroy_on_shutdown=True, max_sandboxes=200, cpu_capacity=100.0, control_plane_url=ctl.url,
        heartbeat_interval_s=0.2,
    )
    edge = await asyncio.to_thread(lambda: EdgeThread(cfg).start())
    try:
        async with httpx.AsyncClient(base_url=ctl.url, headers={"authorization": f"Bearer {ctl.admin_token}"}) as c:
            for _ in range(200):  # registered, with the run id leases are granted for
                edges = (await c.get("/v1/edges")).json()
                if edges and (edges[0].get("health") or {}).get("boot_id"):
                    break
                await asyncio.sleep(0.05)
        yield Stack(ctl, edge)
    finally:
        await asyncio.to_thread(edge.stop)
        await ctl.stop()


async def test_create_many_goes_through_one_lease_and_every_sandbox_is_recorded(
    edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path, db_url: str
) -> None:
    from dsec.sdk import AsyncClient
    from dsec.spec import SandboxSpec

    async with stack(edge_state, dsec_base, tmp_path, db_url) as st, \
            httpx.AsyncClient(base_url=st.ctl.url, headers={"authorization": f"Bearer {st.ctl.admin_token}"}) as c, \
            AsyncClient(st.ctl.url, st.ctl.admin_token) as sdk:
        spec = SandboxSpec.model_validate(SPEC)
        outs = [o async for o in sdk.create_many(spec, 6, labels={"job": "lease"}, task="t")]
        assert all(o.ok for o in outs), [str(o.error) for o in outs]
        boxes = [o.sandbox for o in outs if o.sandbox is not None]
        assert sorted(o.index for o in outs) == list(range(6))
        assert all(b.id.startswith("lx-") and b.info.project == "root" for b in boxes)
        assert st.control.leases.granted == 6  # one grant; no control-plane create per sandbox
        res = await boxes[0].exec(["echo", "hi"])  # the edge's own token works on the data path
        assert res.stdout == b"hi\n"
        rows = await st.recorded(c, 6, label="job=lease")
        assert {r["id"] for r in rows} == {b.id for b in boxes}
        assert {r["state"] for r in rows} == {"running"} and {r["task"] for r in rows} == {"t"}
        assert await st.used(c) == 6 and await st.committed(c) == 6  # the released rest returned
        await boxes[1].close()  # through the control plane, which knows it now
        assert (await c.get(f"/v1/sandboxes/{boxes[1].id}")).json()["state"] == "stopped"
        assert await st.used(c) == 5
        assert await sdk.delete_where(labels={"job": "lease"}) == 5
        assert await st.used(c) == 0


async def test_lease_charges_at_grant_returns_on_release_and_resends_make_nothing_twice(
    edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path, db_url: str
) -> None:
    from dsec.sdk import AsyncClient
    from dsec.spec import SandboxSpec

    async with stack(edge_state, dsec_base, tmp_path, db_url) as st, \
            httpx.AsyncClient(base_url=st.ctl.url, headers={"authorization": f"Bearer {st.ctl.admin_token}"}) as c:
        r = await c.post("/v1/projects", json={"name": "small", "quota": {"sandboxes": 5, "cpu": 10, "memory": 1 << 32}})
        assert r.status_code == 201, r.text
        tok = (await c.post("/v1/tokens", json={"project": "small"})).json()["token"]
        async with AsyncClient(st.ctl.url, tok) as sdk:
            spec = SandboxSpec.model_validate(SPEC)
            lease = await sdk.lease(spec, 8, request_id="burst-1")
            assert (lease.slots, lease.short) == (5, 3) and isinstance(lease.error, QuotaExceeded)
            assert await st.used(c, "small") == 5 and await st.committed(c) == 5  # charged at the grant
            again = await sdk.lease(spec, 8, request_id="burst-1")  # a retried grant: the same, no second charge
            assert [p.lease_id for p in again.grant.leases] == [p.lease_id for p in lease.grant.leases]
            assert await st.used(c, "small") == 5
            with pytest.raises(QuotaExceeded):
                await sdk.lease(spec, 1)
            part = lease.grant.leases[0]
            body = {"body": lease.grant.body, "count": 2, "request_id": "chunk-a"}
            hdr = {"authorization": f"Bearer {part.token}"}
            async with httpx.AsyncClient(base_url=part.edge_url, headers=hdr) as e:
                first = (await e.post(f"/v1/leases/{part.lease_id}/sandboxes", json=body)).json()["items"]
                resent = (await e.post(f"/v1/leases/{part.lease_id}/sandboxes", json=body)).json()["items"]
                assert [i["sandbox"]["id"] for i in first] == [i["sandbox"]["id"] for i in resent]
                r = await e.get(f"/v1/sandboxes/{first[0]['sandbox']['id']}")  # a lease token opens no sandbox
                assert r.status_code == 403
            made = [o async for o in lease.create(1)]
            assert made[0].ok
            rel = await lease.release()
            assert (rel.made, rel.returned, rel.pending) == (3, 2, [])
            assert await st.used(c, "small") == 3 and await st.committed(c) == 3
            assert len(await st.recorded(c, 3)) == 3
            async with httpx.AsyncClient(base_url=part.edge_url, headers=hdr) as e:  # released: revoked there
                r = await e.post(f"/v1/leases/{part.lease_id}/sandboxes", json={**body, "request_id": "chunk-b"})
                assert r.status_code == 409 and r.json()["error"]["reason"] == "revoked"
            with pytest.raises(LeaseInvalid):  # a released grant is not answered again
                await sdk.lease(spec, 8, request_id="burst-1")
            assert (await lease.release()).made == 3  # idempotent


async def test_edge_refuses_other_bodies_and_expired_leases_and_the_sweep_returns_their_quota(
    edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsec.control import leases as leases_mod

    monkeypatch.setattr(leases_mod, "EXPIRY_GRACE_S", 0.0)
    async with stack(edge_state, dsec_base, tmp_path, db_url) as st, \
            httpx.AsyncClient(base_url=st.ctl.url, headers={"authorization": f"Bearer {st.ctl.admin_token}"}) as c:
        g = (await c.post("/v1/leases", json={"spec": SPEC, "count": 3, "lease_ttl_s": 1.5})).json()
        part = g["leases"][0]
        hdr = {"authorization": f"Bearer {part['token']}"}
        async with httpx.AsyncClient(base_url=part["edge_url"], headers=hdr) as e:
            other = {**g["body"], "labels": {"sneaky": "1"}}
            r = await e.post(f"/v1/leases/{part['lease_id']}/sandboxes", json={"body": other, "count": 1, "request_id": "x"})
            assert r.status_code == 409 and r.json()["error"]["reason"] == "wrong body"
            r = await e.post(f"/v1/leases/{part['lease_id']}/sandboxes",
                             json={"body": g["body"], "count": 4, "request_id": "y"})
            items = r.json()["items"]
            assert [i["sandbox"] is not None for i in items] == [True, True, True, False]
            assert items[3]["error"]["reason"] == "used up"
            assert await st.used(c) == 3
            await asyncio.sleep(1.6)
            r = await e.post(f"/v1/leases/{part['lease_id']}/sandboxes", json={"body": g["body"], "count": 1, "request_id": "z"})
            assert r.status_code == 409 and r.json()["error"]["reason"] == "expired"
        await st.recorded(c, 3)
        # the replica's own sweeper runs too (every 2 s): count what either returned
        before = st.control.leases.returned
        await st.control.leases.sweep()
        assert st.control.leases.returned == before  # every slot was used: nothing to return
        g2 = (await c.post("/v1/leases", json={"spec": SPEC, "count": 100, "lease_ttl_s": 0.5})).json()
        assert await st.used(c) == 103 and sum(p["slots"] for p in g2["leases"]) == 100  # (PostgreSQL: by COPY)
        await asyncio.sleep(0.6)
        await st.control.leases.sweep()
        assert st.control.leases.returned - before == 100  # never used: all of it returns
        assert await st.used(c) == 3 and await st.committed(c) == 3
        assert g2["leases"]


async def test_lost_reports_are_recorded_by_the_reconcile_and_a_revoked_token_ends_its_leases(
    edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path, db_url: str
) -> None:
    async with stack(edge_state, dsec_base, tmp_path, db_url) as st, \
            httpx.AsyncClient(base_url=st.ctl.url, headers={"authorization": f"Bearer {st.ctl.admin_token}"}) as c:
        st.edge.service.leases.report = None  # the edge's reports never arrive
        g = (await c.post("/v1/leases", json={"spec": SPEC, "count": 2})).json()
        part = g["leases"][0]
        async with httpx.AsyncClient(base_url=part["edge_url"], headers={"authorization": f"Bearer {part['token']}"}) as e:
            items = (await e.post(f"/v1/leases/{part['lease_id']}/sandboxes",
                                  json={"body": g["body"], "count": 2, "request_id": "r"})).json()["items"]
        ids = {i["sandbox"]["id"] for i in items}
        assert (await c.get("/v1/sandboxes")).json() == []  # not recorded yet
        first = sorted(ids)[0]
        r = await c.get(f"/v1/sandboxes/{first}")  # a lookup by id asks the edge and records it
        assert r.status_code == 200 and r.json()["state"] == "running" and r.json()["token"]
        assert [x["id"] for x in (await c.get("/v1/sandboxes")).json()] == [first]
        await st.control.watcher.tick(reconcile=True)  # the other one: by its key, from the listing
        rows = (await c.get("/v1/sandboxes")).json()
        assert {r["id"] for r in rows} == ids and {r["state"] for r in rows} == {"running"}
        assert await st.used(c) == 2

        r = await c.post("/v1/tokens", json={"project": "root", "name": "job"})
        job = r.json()
        g = (await c.post("/v1/leases", json={"spec": SPEC, "count": 3},
                          headers={"authorization": f"Bearer {job['token']}"})).json()
        assert await st.used(c) == 5
        assert (await c.delete(f"/v1/tokens/{job['id']}")).status_code == 204
        assert await st.used(c) == 2  # its unused lease returned with it
        part = g["leases"][0]
        async with httpx.AsyncClient(base_url=part["edge_url"], headers={"authorization": f"Bearer {part['token']}"}) as e:
            r = await e.post(f"/v1/leases/{part['lease_id']}/sandboxes", json={"body": g["body"], "count": 1, "request_id": "q"})
            assert r.status_code == 409 and r.json()["error"]["reason"] == "revoked"


async def test_repeated_creates_take_a_lease_held_ahead_but_never_the_quota_others_need(
    edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path, db_url: str
) -> None:
    from dsec.sdk import AsyncClient
    from dsec.spec import SandboxSpec

    async with stack(edge_state, dsec_base, tmp_path, db_url) as st, \
            httpx.AsyncClient(base_url=st.ctl.url, headers={"authorization": f"Bearer {st.ctl.admin_token}"}) as c:
        spec = SandboxSpec.model_validate(SPEC)
        async with AsyncClient(st.ctl.url, st.ctl.admin_token, lease_ahead=4) as sdk:
            boxes = []
            for _ in range(8):
                boxes.append(await sdk.create(spec, labels={"job": "ahead"}))
                await asyncio.sleep(0.05)  # the second create asks for the lease in the background
            assert sdk._ahead is not None and sdk._ahead.hits >= 4, (sdk._ahead.hits, sdk._ahead.misses)
            assert len({b.id for b in boxes}) == 8
            r = await c.get(f"/v1/sandboxes/{boxes[-1].id}")  # known at once (asked of its edge if need be)
            assert r.status_code == 200 and r.json()["state"] == "running"
            for b in boxes:
                await b.close()
        assert len(await st.recorded(c, 8, label="job=ahead", state="stopped")) == 8
        assert await st.used(c) == 0 and await st.committed(c) == 0  # closing the client handed the lease back

        # a project with little quota left gets no lease ahead: every create still fits
        r = await c.post("/v1/projects", json={"name": "tight", "quota": {"sandboxes": 6, "cpu": 10, "memory": 1 << 32}})
        assert r.status_code == 201, r.text
        tok = (await c.post("/v1/tokens", json={"project": "tight"})).json()["token"]
        async with AsyncClient(st.ctl.url, tok, lease_ahead=4) as sdk:
            made = []
            for _ in range(6):
                made.append(await sdk.create(spec))
                await asyncio.sleep(0.05)
            assert sdk._ahead is not None and sdk._ahead.hits == 0
            with pytest.raises(QuotaExceeded):
                await sdk.create(spec)
            for b in made:
                await b.close()


async def test_a_lease_held_ahead_yields_to_a_create_refused_for_quota(
    edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path, db_url: str
) -> None:
    from dsec.sdk import AsyncClient
    from dsec.spec import SandboxSpec

    async with stack(edge_state, dsec_base, tmp_path, db_url) as st, \
            httpx.AsyncClient(base_url=st.ctl.url, headers={"authorization": f"Bearer {st.ctl.admin_token}"}) as c:
        spec = SandboxSpec.model_validate(SPEC)
        r = await c.post("/v1/projects", json={"name": "q", "quota": {"sandboxes": 12, "cpu": 10, "memory": 1 << 32}})
        assert r.status_code == 201, r.text
        tok = (await c.post("/v1/tokens", json={"project": "q"})).json()["token"]
        async with AsyncClient(st.ctl.url, tok, lease_ahead=4) as a, AsyncClient(st.ctl.url, tok, lease_ahead=0) as b:
            mine = []
            for _ in range(3):
                mine.append(await a.create(spec))
                await asyncio.sleep(0.1)
            assert a._ahead is not None and a._ahead.hits >= 1
            assert await st.used(c, "q") > 3  # the lease's unused slots hold quota
            others = [await b.create(spec) for _ in range(9)]  # 3 + 9 = 12: every one fits
            assert await st.used(c, "q") == 12
            with pytest.raises(QuotaExceeded):
                await b.create(spec)
            for sb in mine + others:
                await sb.close()
        assert await st.used(c, "q") == 0


# ----------------------------------------------------------------- abandon ----


def _edge_admin() -> dict[str, str]:
    from dsec.http import auth

    tok, _ = auth.mint(KEY, sandbox_id="*", project="*", ttl_s=600, scope="edge-admin")
    return {"authorization": f"Bearer {tok}"}


async def _made_on_edge(st: Stack, grant: dict[str, Any], key: str) -> dict[str, Any]:
    """A sandbox the edge makes under a lease slot's key, as it would for a chunk whose answer (and
    report) never reached anyone: what a partitioned or restarted edge holds."""
    async with httpx.AsyncClient(base_url=grant["leases"][0]["edge_url"], headers=_edge_admin()) as e:
        r = await e.post("/v1/sandboxes", json={**grant["body"], "request_id": key})
        assert r.status_code in (200, 201), r.text
        return dict(r.json())


async def _on_edge(st: Stack) -> set[str]:
    async with httpx.AsyncClient(base_url=st.edge.url, headers=_edge_admin()) as e:
        data = (await e.get("/v1/sandboxes")).json()
    items = data["items"] if isinstance(data, dict) else data
    return {x["id"] for x in items if x.get("project") is not None and x["state"] != "stopped"}


async def _books_agree(st: Stack) -> None:
    """Every counter equals a recount of the sandbox rows; no reservation is left."""
    import sqlalchemy as sa

    from dsec.control.db import SandboxRow
    from dsec.control.watcher import recount_txn

    assert await st.control.store.write(recount_txn) == 0
    left = await st.control.store.read(lambda s: s.execute(sa.select(sa.func.count()).select_from(SandboxRow).where(
        SandboxRow.id.is_(None), SandboxRow.state == "creating")).scalar_one())
    assert left == 0


async def test_abandon_gives_up_the_slots_the_sdk_does_not_hold_and_destroys_what_the_edge_made_there(
    edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path, db_url: str
) -> None:
    from dsec.edge.leases import slot_key

    async with stack(edge_state, dsec_base, tmp_path, db_url) as st, \
            httpx.AsyncClient(base_url=st.ctl.url, headers={"authorization": f"Bearer {st.ctl.admin_token}"}) as c:
        g = (await c.post("/v1/leases", json={"spec": SPEC, "count": 8, "labels": {"job": "ab"}})).json()
        part = g["leases"][0]
        lid = part["lease_id"]
        async with httpx.AsyncClient(base_url=part["edge_url"], headers={"authorization": f"Bearer {part['token']}"}) as e:
            async def chunk(rid: str) -> list[dict[str, Any]]:
                r = await e.post(f"/v1/leases/{lid}/sandboxes", json={"body": g["body"], "count": 2, "request_id": rid})
                return [i["sandbox"] for i in r.json()["items"]]

            held = await chunk("a")  # the SDK got these
            lost = await chunk("b")  # made, but their answer never reached the SDK
        keys = [sb["request_id"] for sb in held]
        assert all(k and k.startswith(lid) for k in keys), keys  # the edge names each sandbox's slot
        await st.recorded(c, 4, label="job=ab")
        assert await st.used(c) == 8 and await st.committed(c) == 8

        ab = {"lease_id": lid, "held": keys, "request_id": "ab-1"}
        r = await c.post(f"/v1/leases/{g['id']}/abandon", json=ab)
        assert r.status_code == 200, r.text
        got = r.json()
        assert (got["kept"], got["returned"], sorted(got["stopped"]), got["edge_told"], got["replayed"]) == \
            (2, 4, sorted(sb["id"] for sb in lost), True, False)
        # the two it holds stand; what nobody holds is destroyed; the unused slots' quota is back
        assert await st.used(c) == 2 and await st.committed(c) == 2
        assert await _on_edge(st) == {sb["id"] for sb in held}
        for sb in lost:
            row = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
            assert row["state"] == "stopped" and "abandoned" in row["reason"], row
        async with httpx.AsyncClient(base_url=part["edge_url"], headers={"authorization": f"Bearer {part['token']}"}) as e:
            r = await e.post(f"/v1/leases/{lid}/sandboxes", json={"body": g["body"], "count": 1, "request_id": "c"})
            assert r.status_code == 409 and r.json()["error"]["reason"] == "revoked"  # the edge was told

        # idempotent: the same call (another replica, a lost answer) gets the same decision
        again = (await c.post(f"/v1/leases/{g['id']}/abandon", json=ab)).json()
        assert (again["kept"], again["returned"], again["stopped"], again["replayed"]) == \
            (2, 4, got["stopped"], True)
        r = await c.post(f"/v1/leases/{g['id']}/abandon", json={**ab, "held": keys[:1]})
        assert r.status_code == 422 and r.json()["error"]["field"] == "request_id"
        r = await c.post(f"/v1/leases/{g['id']}/abandon", json={**ab, "held": keys[:1], "request_id": "ab-2"})
        assert r.status_code == 409 and r.json()["error"]["reason"] == "abandoned"
        r = await c.post(f"/v1/leases/{g['id']}/abandon", json={**ab, "held": [lid + "ffffffff"], "request_id": "x"})
        assert r.status_code in (409, 422)
        r = await c.post(f"/v1/leases/{g['id']}/abandon", json={**ab, "lease_id": "0" * 24})
        assert r.status_code == 404

        # what the edge made under a slot given up and tells of later (a healed partition): into the
        # slot's row, never charged, destroyed by the reconcile; and one it never reports at all
        late = await _made_on_edge(st, g, slot_key(lid, 6))
        r = await c.post(f"/v1/edges/{part['edge_id']}/leases/report", headers=_edge_admin(), json={"items": [{
            "key": slot_key(lid, 6), "id": late["id"], "state": "running", "created_at": late["created_at"]}]})
        assert r.status_code == 200, r.text
        silent = await _made_on_edge(st, g, slot_key(lid, 7))
        assert await st.used(c) == 2
        assert (await c.get(f"/v1/sandboxes/{late['id']}")).json()["state"] == "stopped"
        await st.control.watcher.tick(reconcile=True)
        assert await _on_edge(st) == {sb["id"] for sb in held}
        assert (await c.get(f"/v1/sandboxes/{silent['id']}")).json()["state"] == "stopped"
        assert await st.used(c) == 2 and await st.committed(c) == 2
        await _books_agree(st)
        assert (await c.delete(f"/v1/leases/{g['id']}")).status_code == 200  # releasing after: nothing changes
        assert await st.used(c) == 2
        for sb in held:
            await c.delete(f"/v1/sandboxes/{sb['id']}")
        assert await st.used(c) == 0 and await st.committed(c) == 0


async def test_abandon_after_the_lease_expired_keeps_late_reports_of_held_slots_and_destroys_the_others(
    edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsec.control import leases as leases_mod

    monkeypatch.setattr(leases_mod, "EXPIRY_GRACE_S", 0.0)
    async with stack(edge_state, dsec_base, tmp_path, db_url) as st, \
            httpx.AsyncClient(base_url=st.ctl.url, headers={"authorization": f"Bearer {st.ctl.admin_token}"}) as c:
        book = st.edge.service.leases
        report, book.report = book.report, None  # the edge is cut off: its reports do not arrive
        g = (await c.post("/v1/leases", json={"spec": SPEC, "count": 3, "lease_ttl_s": 1.0})).json()
        part = g["leases"][0]
        async with httpx.AsyncClient(base_url=part["edge_url"], headers={"authorization": f"Bearer {part['token']}"}) as e:
            items = (await e.post(f"/v1/leases/{part['lease_id']}/sandboxes",
                                  json={"body": g["body"], "count": 2, "request_id": "a"})).json()["items"]
        mine, unknown = items[0]["sandbox"], items[1]["sandbox"]  # the SDK got the first answer only
        before = st.control.leases.returned  # the replica's own sweeper may be first: count either's
        await asyncio.sleep(1.1)
        await st.control.leases.sweep()
        assert st.control.leases.returned - before == 3  # expired, nothing reported: every slot returned
        assert await st.used(c) == 0
        r = await c.post(f"/v1/leases/{g['id']}/abandon",
                         json={"lease_id": part["lease_id"], "held": [mine["request_id"]], "request_id": "ab"})
        assert r.status_code == 200, r.text
        assert (r.json()["kept"], r.json()["returned"], r.json()["stopped"]) == (1, 0, [])
        # the partition heals: the edge reports both. The held one is the client's (charged, kept);
        # the other goes into its given-up slot (never charged) and is destroyed
        book.report = report
        items = [{"key": sb["request_id"], "id": sb["id"], "state": "running", "created_at": sb["created_at"]}
                 for sb in (mine, unknown)]
        r = await c.post(f"/v1/edges/{part['edge_id']}/leases/report", headers=_edge_admin(), json={"items": items})
        assert r.status_code == 200, r.text
        assert (await c.get(f"/v1/sandboxes/{mine['id']}")).json()["state"] == "running"
        assert (await c.get(f"/v1/sandboxes/{unknown['id']}")).json()["state"] == "stopped"
        assert await st.used(c) == 1
        await st.control.watcher.tick(reconcile=True)
        assert await _on_edge(st) == {mine["id"]}
        assert await st.used(c) == 1 and await st.committed(c) == 1
        await _books_agree(st)
        await c.delete(f"/v1/sandboxes/{mine['id']}")


async def test_a_report_committed_during_a_reconcile_is_not_taken_for_an_ended_sandbox(
    edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path, db_url: str
) -> None:
    """The reconcile reads what the store knows, then (a statement later) which of the edge's
    unknown ids the store has ended. A report that commits in between (PostgreSQL's read committed:
    each statement sees the commits before it) made a live sandbox look ended, and the reconcile
    deleted it on its edge (found by tests/cluster's lease bursts). The report is made to land
    exactly there."""
    import sqlalchemy as sa

    from dsec.spec.api import LeaseReportItem

    if db_url.startswith("sqlite"):
        pytest.skip("SQLite runs one write transaction at a time: a report cannot commit inside a reconcile")
    async with stack(edge_state, dsec_base, tmp_path, db_url) as st, \
            httpx.AsyncClient(base_url=st.ctl.url, headers={"authorization": f"Bearer {st.ctl.admin_token}"}) as c:
        st.edge.service.leases.report = None  # the report comes when the test says
        g = (await c.post("/v1/leases", json={"spec": SPEC, "count": 1})).json()
        part = g["leases"][0]
        async with httpx.AsyncClient(base_url=part["edge_url"], headers={"authorization": f"Bearer {part['token']}"}) as e:
            sb = (await e.post(f"/v1/leases/{part['lease_id']}/sandboxes",
                               json={"body": g["body"], "count": 1, "request_id": "r"})).json()["items"][0]["sandbox"]
        item = LeaseReportItem(key=sb["request_id"], id=sb["id"], state="running", created_at=sb["created_at"])
        store, fired = st.control.store, []

        def between(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
            # the reconcile's second look at the edge's unknown ids: the report commits just before it
            if not fired and statement.lstrip().startswith("SELECT sandboxes.id") and "sandboxes.id IN" in statement:
                fired.append(statement)
                store.run_sync(lambda s: st.control.leases._report_txn(s, part["edge_id"], [item]), write=True)

        sa.event.listen(store.engine, "before_cursor_execute", between)
        try:
            await st.control.watcher.tick(reconcile=True)
        finally:
            sa.event.remove(store.engine, "before_cursor_execute", between)
        assert fired
        assert await _on_edge(st) == {sb["id"]}  # not deleted there
        row = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
        assert row["state"] == "running", row
        await st.control.watcher.tick(reconcile=True)  # the next round knows it
        assert await _on_edge(st) == {sb["id"]} and await st.used(c) == 1
        await _books_agree(st)
        await c.delete(f"/v1/sandboxes/{sb['id']}")


async def test_a_sandbox_recorded_while_its_edge_was_making_it_runs_once_reported_made(
    edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path, db_url: str
) -> None:
    # the reconcile (or a report) may record a slot's sandbox while the edge still makes it; the
    # report that it is made moves it on at once (it was taken for "recorded already")
    async with stack(edge_state, dsec_base, tmp_path, db_url) as st, \
            httpx.AsyncClient(base_url=st.ctl.url, headers={"authorization": f"Bearer {st.ctl.admin_token}"}) as c:
        st.edge.service.leases.report = None
        g = (await c.post("/v1/leases", json={"spec": SPEC, "count": 1})).json()
        part = g["leases"][0]
        async with httpx.AsyncClient(base_url=part["edge_url"], headers={"authorization": f"Bearer {part['token']}"}) as e:
            sb = (await e.post(f"/v1/leases/{part['lease_id']}/sandboxes",
                               json={"body": g["body"], "count": 1, "request_id": "r"})).json()["items"][0]["sandbox"]
        url = f"/v1/edges/{part['edge_id']}/leases/report"
        item = {"key": sb["request_id"], "id": sb["id"], "created_at": sb["created_at"]}
        assert (await c.post(url, headers=_edge_admin(), json={"items": [{**item, "state": "creating"}]})).status_code == 200
        assert (await c.get(f"/v1/sandboxes/{sb['id']}")).json()["state"] == "creating"
        assert (await c.post(url, headers=_edge_admin(), json={"items": [{**item, "state": "running"}]})).status_code == 200
        assert (await c.get(f"/v1/sandboxes/{sb['id']}")).json()["state"] == "running"
        assert await st.used(c) == 1
        await _books_agree(st)
        await c.delete(f"/v1/sandboxes/{sb['id']}")
