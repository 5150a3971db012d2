"""Create leases: a part the SDK abandoned records that decision (docs/CONTROL.md, "Create leases").

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("create_leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("abandon", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("create_leases", schema=None) as batch_op:
        batch_op.drop_column("abandon")
