"""Scheduling: task priorities, preemption policies, elastic minimums, burst eligibility;
sandbox priorities and preemption marks; the scheduler's events (docs/CONTROL.md, "Scheduling").

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sched_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.Double(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=True),
        sa.Column("task_name", sa.String(length=63), nullable=True),
        sa.Column("sandbox_id", sa.String(length=63), nullable=True),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("sched_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_sched_events_at"), ["at"], unique=False)
        batch_op.create_index(batch_op.f("ix_sched_events_project_id"), ["project_id"], unique=False)

    with op.batch_alter_table("sandboxes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("priority", sa.Integer(), server_default="200", nullable=False))
        batch_op.add_column(sa.Column("preempted_at", sa.Double(), nullable=True))
        batch_op.add_column(sa.Column("preemption", sa.JSON(), nullable=True))
        batch_op.create_index("ix_sandboxes_edge_victims", ["edge_id", "state", "priority", "created_at"], unique=False)

    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("priority", sa.Integer(), server_default="200", nullable=False))
        batch_op.add_column(sa.Column("preemption", sa.String(length=8), server_default="pause", nullable=False))
        batch_op.add_column(sa.Column("burst", sa.Boolean(), server_default=sa.true(), nullable=False))
        batch_op.add_column(sa.Column("min_sandboxes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("min_cpu_m", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("min_memory", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("active_sandboxes", sa.BigInteger(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("active_cpu_m", sa.BigInteger(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("active_memory", sa.BigInteger(), server_default="0", nullable=False))
    # nothing was preempted before: every sandbox a task holds is active
    op.execute("UPDATE tasks SET active_sandboxes = used_sandboxes, active_cpu_m = used_cpu_m, "
               "active_memory = used_memory")


def downgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        for col in ("active_memory", "active_cpu_m", "active_sandboxes", "min_memory", "min_cpu_m", "min_sandboxes",
                    "burst", "preemption", "priority"):
            batch_op.drop_column(col)
    with op.batch_alter_table("sandboxes", schema=None) as batch_op:
        batch_op.drop_index("ix_sandboxes_edge_victims")
        batch_op.drop_column("preemption")
        batch_op.drop_column("preempted_at")
        batch_op.drop_column("priority")
    with op.batch_alter_table("sched_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_sched_events_project_id"))
        batch_op.drop_index(batch_op.f("ix_sched_events_at"))
    op.drop_table("sched_events")
