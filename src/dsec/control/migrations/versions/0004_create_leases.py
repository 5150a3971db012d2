"""Create leases: the right to make N sandboxes of one body directly on an edge.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "create_leases",
        sa.Column("id", sa.String(length=24), nullable=False),
        sa.Column("grant_id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("token_id", sa.String(length=32), nullable=True),
        sa.Column("request_id", sa.String(length=160), nullable=True),
        sa.Column("edge_id", sa.String(length=16), nullable=False),
        sa.Column("granted", sa.Integer(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=8), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("closed_at", sa.Double(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("create_leases", schema=None) as batch_op:
        batch_op.create_index("ix_create_leases_project_grant", ["project_id", "grant_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_create_leases_state"), ["state"], unique=False)
        batch_op.create_index(batch_op.f("ix_create_leases_token_id"), ["token_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("create_leases", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_create_leases_token_id"))
        batch_op.drop_index(batch_op.f("ix_create_leases_state"))
        batch_op.drop_index("ix_create_leases_project_grant")
    op.drop_table("create_leases")
