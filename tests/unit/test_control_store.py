"""The store's group commit: concurrent writes share a transaction, a failing one fails alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from dsec.control.db import Lease, Store

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(f"sqlite:///{tmp_path / 'c.db'}", threads=2)
    s.migrate()
    return s


def _add(name: str, *, fail: str | None = None):  # type: ignore[no-untyped-def]
    def txn(s: Session) -> str:
        if fail == "before":
            raise ValueError(f"{name}: refused before writing")
        s.add(Lease(name=name, holder="t", expires_at=0.0))
        s.flush()
        if fail == "after":
            raise ValueError(f"{name}: failed after writing")
        if fail == "db":
            s.execute(sa.text("INSERT INTO leases (name, holder, expires_at) VALUES ('dup', 'x', 0)"))
            s.execute(sa.text("INSERT INTO leases (name, holder, expires_at) VALUES ('dup', 'x', 0)"))
        return name

    return txn


async def test_group_commit_isolates_failures(store: Store) -> None:
    calls = [
        store.write_grouped(_add("a")),
        store.write_grouped(_add("b", fail="after")),  # its own write is rolled back, alone
        store.write_grouped(_add("c", fail="before"), checks_first=True),
        store.write_grouped(_add("d"), checks_first=True),
        store.write_grouped(_add("e")),
    ]
    res = await asyncio.gather(*calls, return_exceptions=True)
    assert res[0] == "a" and res[3] == "d" and res[4] == "e"
    assert isinstance(res[1], ValueError) and isinstance(res[2], ValueError)
    names = await store.read(lambda s: sorted(s.execute(sa.select(Lease.name)).scalars()))
    assert names == ["a", "d", "e"]


async def test_a_database_error_without_savepoint_reruns_the_group_carefully(store: Store) -> None:
    res = await asyncio.gather(
        store.write_grouped(_add("x")),
        store.write_grouped(_add("y", fail="db"), checks_first=True),  # breaks the promise
        store.write_grouped(_add("z"), checks_first=True),
        return_exceptions=True,
    )
    assert res[0] == "x" and res[2] == "z"
    assert isinstance(res[1], Exception)
    names = await store.read(lambda s: sorted(s.execute(sa.select(Lease.name)).scalars()))
    assert names == ["x", "z"]
    store.close()
