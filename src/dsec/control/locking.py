"""Rows taken for update by a transaction that looked them up first: gone or changed meanwhile.

On PostgreSQL (READ COMMITTED) every statement sees what was committed when it
began: a row one statement found may be deleted or changed by another
transaction before the next statement locks it, and ``SELECT ... FOR UPDATE``
then finds nothing, or the newer version (it waits for the other writer, then
re-checks its WHERE on what that writer left). Likewise a row our lookup could
not see yet (inserted, not committed) makes our own INSERT of the same key fail
once its writer commits. On SQLite a write transaction holds the database from
``BEGIN IMMEDIATE`` on, so nothing changes between two of its statements; the
same code runs there and the branches below are simply not taken.

Transactions that depend on a row they found go through these two helpers, so
"gone meanwhile" is a typed answer (404 / 409) and never ``NoResultFound``,
``StaleDataError`` or ``IntegrityError`` (500). A caller re-checks the state of
what :func:`lock_one` returns: that version is the one its write applies to.

Runs inside one store transaction; never awaits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from dsec.errors import DsecError

T = TypeVar("T")


def lock_one(s: Session, stmt: sa.Select[T], gone: Callable[[], DsecError]) -> T:
    """The one row ``stmt`` selects, locked for this transaction and read again (objects an
    earlier lookup loaded are refreshed); raises ``gone()`` when no row matches any more."""
    row = s.execute(stmt.with_for_update().execution_options(populate_existing=True)).scalar_one_or_none()
    if row is None:
        raise gone()
    return row


def add_new(s: Session, row: object) -> bool:
    """Insert ``row`` in a savepoint. False: another transaction inserted the same key after our
    lookup found none (or a row it refers to went away); the savepoint is undone and this
    transaction goes on, so the caller can look again (with :func:`lock_one`) or refuse."""
    try:
        with s.begin_nested():
            s.add(row)
    except IntegrityError:
        return False
    return True
