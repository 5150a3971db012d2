"""Snapshot storage quota on projects, the snapshots table, stages on tasks.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.add_column(sa.Column("quota_storage", sa.BigInteger(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("used_storage", sa.BigInteger(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("reserved_storage", sa.BigInteger(), server_default="0", nullable=False))
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("stages", sa.JSON(), nullable=True))
    op.create_table(
        "snapshots",
        sa.Column("key", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("edge_id", sa.String(length=16), nullable=False),
        sa.Column("sandbox_id", sa.String(length=63), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("digest", sa.String(length=80), nullable=True),
        sa.Column("ref", sa.String(length=300), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("parents", sa.JSON(), nullable=False),
        sa.Column("info", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("key"),
    )
    with op.batch_alter_table("snapshots", schema=None) as batch_op:
        batch_op.create_index("ix_snapshots_edge_digest", ["edge_id", "digest"], unique=False)
        batch_op.create_index(batch_op.f("ix_snapshots_project_id"), ["project_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("snapshots", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_snapshots_project_id"))
        batch_op.drop_index("ix_snapshots_edge_digest")
    op.drop_table("snapshots")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_column("stages")
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.drop_column("reserved_storage")
        batch_op.drop_column("used_storage")
        batch_op.drop_column("quota_storage")
