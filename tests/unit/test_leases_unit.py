"""Create leases, the pure parts: lease tokens, the edge's lease book, splitting a grant over edges.

The book's ``make`` here is a plain function that records what it was asked to make (the
edge service's create in production); the end-to-end behaviour against a real edge agent
and both stores is in tests/integration/test_control_leases.py.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from dsec.control.iam import Amount
from dsec.control.leases import how_many_fit, split
from dsec.control.placement import Demand, EdgeView, Room
from dsec.edge.leases import LeaseBook, slot_key
from dsec.errors import AuthError, Backpressure, DsecError, Forbidden, LeaseInvalid
from dsec.http import auth
from dsec.spec import SandboxState
from dsec.spec.api import EdgeCreateSandbox, LeaseReportItem, SandboxInfo

KEY = auth.new_key()
BODY: dict[str, Any] = {"spec": {"image": {"base": "busybox:latest"}, "resources": {"cpu": 0.5, "memory": 1 << 26}},
                        "lifecycle": {"ttl_s": 60.0}, "labels": {"job": "x"}, "task": None, "project": "p"}


def _token(lease_id: str = "a" * 24, *, slots: int = 3, edge: str = "e1", boot: str = "boot1",
           body: dict[str, Any] | None = None, ttl: float = 30.0) -> str:
    return auth.mint_lease(KEY, lease_id=lease_id, project="p", edge_id=edge, boot_id=boot, slots=slots,
                           body_digest=auth.body_hash(body or BODY), ttl_s=ttl)[0]


class Maker:
    """Makes a SandboxInfo per request id, once (as the edge's create de-duplicates)."""

    def __init__(self, *, refuse: int = 0, delay: float = 0.0) -> None:
        self.made: dict[str, SandboxInfo] = {}
        self.calls = 0
        self.refuse = refuse
        self.delay = delay

    async def __call__(self, req: EdgeCreateSandbox) -> SandboxInfo:
        self.calls += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.refuse:
            self.refuse -= 1
            raise Backpressure("edge full", reason="memory")
        assert req.request_id is not None and req.project == "p"
        if req.request_id not in self.made:
            self.made[req.request_id] = SandboxInfo(id=f"e1-{len(self.made):012x}", state=SandboxState.RUNNING,
                                                    edge_id="e1", edge_url="http://e1", created_at=time.time(),
                                                    labels=dict(req.labels))
        return self.made[req.request_id]


def _book(maker: Maker, reports: list[LeaseReportItem] | None = None) -> LeaseBook:
    return LeaseBook("e1", KEY, make=maker, report=None if reports is None else reports.append, boot_id="boot1")


def test_lease_tokens_bind_lease_edge_run_slots_and_body() -> None:
    tok = _token()
    c = auth.verify_lease(KEY, tok)
    assert (c.lease_id, c.project, c.edge_id, c.boot_id, c.slots) == ("a" * 24, "p", "e1", "boot1", 3)
    assert c.body_hash == auth.body_hash(dict(reversed(list(BODY.items()))))  # canonical: key order does not count
    with pytest.raises(LeaseInvalid) as ei:
        auth.verify_lease(KEY, tok, now=time.time() + 60)
    assert ei.value.fields["reason"] == "expired"
    with pytest.raises(AuthError):
        auth.verify_lease(auth.new_key(), tok)  # another cluster's key
    sandbox_tok, _ = auth.mint(KEY, sandbox_id="e1-1", project="p")
    with pytest.raises(Forbidden):
        auth.verify_lease(KEY, sandbox_tok)
    with pytest.raises(Forbidden):  # and a lease token opens no sandbox
        auth.check_sandbox(auth.verify(KEY, tok), "e1-1")


def test_book_makes_at_most_its_slots_each_under_its_slot_key_and_reports_them() -> None:
    maker, reports = Maker(), []
    book = _book(maker, reports)

    async def go() -> list[Any]:
        first = await book.create("a" * 24, _token(), BODY, 2, "r1")
        again = await book.create("a" * 24, _token(), BODY, 2, "r1")  # a resent call: the same two
        more = await book.create("a" * 24, _token(), BODY, 2, "r2")  # one slot left
        return [first, again, more]

    first, again, more = asyncio.run(go())
    assert [x.id for x in first] == [x.id for x in again]
    assert isinstance(more[0], SandboxInfo) and isinstance(more[1], LeaseInvalid)
    assert more[1].fields["reason"] == "used up"
    assert sorted(maker.made) == [slot_key("a" * 24, i) for i in range(3)]
    assert [r.key for r in reports] == [slot_key("a" * 24, i) for i in range(3)]
    assert {r.id for r in reports} == {x.id for x in (*first, more[0])}


def test_book_gives_back_the_slot_of_a_refused_create() -> None:
    maker = Maker(refuse=1)
    book = _book(maker)

    async def go() -> tuple[list[Any], list[Any]]:
        a = await book.create("a" * 24, _token(slots=1), BODY, 1, "r1")
        b = await book.create("a" * 24, _token(slots=1), BODY, 1, "r2")
        return a, b

    a, b = asyncio.run(go())
    assert isinstance(a[0], Backpressure)
    assert isinstance(b[0], SandboxInfo)  # the one slot was free again
    assert list(maker.made) == [slot_key("a" * 24, 0)]


def test_book_refuses_another_body_edge_run_or_lease_and_a_revoked_lease() -> None:
    book = _book(Maker(delay=0.05))
    lid = "b" * 24

    async def refused(**kw: Any) -> DsecError:
        body = kw.pop("body", BODY)
        token = kw.pop("token", _token(lid))
        try:
            await book.create(kw.pop("lease", lid), token, body, 1, "r")
        except DsecError as exc:
            return exc
        raise AssertionError("not refused")

    async def go() -> None:
        e = await refused(body={**BODY, "labels": {"job": "y"}})
        assert isinstance(e, LeaseInvalid) and e.fields["reason"] == "wrong body"
        assert isinstance(await refused(token=_token(lid, edge="e2")), Forbidden)
        e = await refused(token=_token(lid, boot="an-earlier-run"))
        assert isinstance(e, LeaseInvalid) and e.fields["reason"] == "unknown"
        assert isinstance(await refused(lease="c" * 24), Forbidden)  # the token names another lease
        assert isinstance(await refused(token=None), AuthError)
        # revoked while a create is in flight: the revoke answers it, later creates are refused
        inflight = asyncio.ensure_future(book.create(lid, _token(lid), BODY, 1, "early"))
        await asyncio.sleep(0.01)
        made = await book.revoke(lid)
        assert [m.key for m in made] == [slot_key(lid, 0)]
        assert isinstance((await inflight)[0], SandboxInfo)
        e = await refused()
        assert isinstance(e, LeaseInvalid) and e.fields["reason"] == "revoked"
        assert await book.revoke("d" * 24) == []  # a lease never seen made nothing

    asyncio.run(go())


def test_book_concurrent_calls_for_one_item_make_one_sandbox() -> None:
    maker = Maker(delay=0.02)
    book = _book(maker)

    async def go() -> list[list[Any]]:
        return list(await asyncio.gather(*(book.create("a" * 24, _token(), BODY, 1, "same") for _ in range(5))))

    out = asyncio.run(go())
    assert len({r[0].id for r in out}) == 1 and maker.calls == 1


def _edges(n: int, cap: int) -> list[EdgeView]:
    return [EdgeView(id=f"e{i}", capacity=Room(cap, cap * 1000, cap << 30, cap << 30), committed=Room(),
                     layers=frozenset({"busybox:latest"})) for i in range(n)]


def test_split_spreads_a_grant_and_stops_at_the_room_there_is() -> None:
    need = Room(1, 500, 1 << 30, 1 << 30)
    demand = Demand(need=need, layers=("busybox:latest",))
    rng = random.Random(1)
    out = split(_edges(8, 100), demand, 400, k=2, rng=rng, require_layers=False)
    assert sum(out.values()) == 400 and len(out) >= 6 and max(out.values()) <= 100
    out = split(_edges(3, 10), demand, 50, k=2, rng=rng, require_layers=False)
    assert out == {"e0": 10, "e1": 10, "e2": 10}  # everything there is, no more
    out = split(_edges(100, 10), demand, 30, k=2, rng=rng, require_layers=False, max_parts=4)
    assert sum(out.values()) == 30 and len(out) <= 4
    assert split(_edges(2, 10), Demand(need=need, selector={"zone": "x"}), 5, k=2, rng=rng,
                 require_layers=False) == {}


def test_how_many_fit_takes_the_tightest_dimension() -> None:
    assert how_many_fit(Amount(10, 4000, 1 << 40), Amount(1, 1000, 1 << 30), 100) == 4
    assert how_many_fit(Amount(3, 10**9, 1 << 40), Amount(1, 0, 0), 100) == 3
    assert how_many_fit(Amount(-1, 0, 0), Amount(1, 1, 1), 5) == 0
