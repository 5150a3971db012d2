"""Alembic environment of the control-plane store, run programmatically by Store.migrate().

The caller hands over an open connection (``config.attributes["connection"]``)
inside its transaction; SQLite gets ``render_as_batch`` so ALTERs become
copy-and-move table rebuilds.
"""

from __future__ import annotations

from alembic import context

from dsec.control.db import Base

connection = context.config.attributes.get("connection")
if connection is None:  # pragma: no cover - offline mode is not used
    raise RuntimeError("run migrations through dsec.control.db.Store.migrate()")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
