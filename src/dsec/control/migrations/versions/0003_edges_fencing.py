"""Edges on other hosts: fencing epochs, bootstrap tokens, replica liveness, create launchers.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("edges", schema=None) as batch_op:
        batch_op.add_column(sa.Column("epoch", sa.BigInteger(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("lost_at", sa.Double(), nullable=True))
    with op.batch_alter_table("sandboxes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("launcher", sa.String(length=32), nullable=True))
    op.create_table(
        "edge_tokens",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("uses", sa.Integer(), nullable=True),
        sa.Column("used", sa.Integer(), nullable=False),
        sa.Column("revoked_at", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("hash"),
    )
    op.create_table(
        "replicas",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("url", sa.String(length=512), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("seen_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("replicas")
    op.drop_table("edge_tokens")
    with op.batch_alter_table("sandboxes", schema=None) as batch_op:
        batch_op.drop_column("launcher")
    with op.batch_alter_table("edges", schema=None) as batch_op:
        batch_op.drop_column("lost_at")
        batch_op.drop_column("epoch")
