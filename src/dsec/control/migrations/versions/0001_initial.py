"""Initial schema: projects, API tokens, tasks, sandboxes, edges, leases.

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "edges",
        sa.Column("id", sa.String(length=16), nullable=False),
        sa.Column("url", sa.String(length=512), nullable=False),
        sa.Column("health", sa.JSON(), nullable=True),
        sa.Column("registered_at", sa.Double(), nullable=False),
        sa.Column("last_seen", sa.Double(), nullable=True),
        sa.Column("status", sa.String(length=8), nullable=False),
        sa.Column("misses", sa.Integer(), nullable=False),
        sa.Column("draining", sa.Boolean(), nullable=False),
        sa.Column("committed_sandboxes", sa.BigInteger(), nullable=False),
        sa.Column("committed_cpu_m", sa.BigInteger(), nullable=False),
        sa.Column("committed_memory", sa.BigInteger(), nullable=False),
        sa.Column("committed_disk", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "leases",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("holder", sa.String(length=64), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "projects",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("quota_sandboxes", sa.BigInteger(), nullable=False),
        sa.Column("quota_cpu_m", sa.BigInteger(), nullable=False),
        sa.Column("quota_memory", sa.BigInteger(), nullable=False),
        sa.Column("used_sandboxes", sa.BigInteger(), nullable=False),
        sa.Column("used_cpu_m", sa.BigInteger(), nullable=False),
        sa.Column("used_memory", sa.BigInteger(), nullable=False),
        sa.Column("reserved_sandboxes", sa.BigInteger(), nullable=False),
        sa.Column("reserved_cpu_m", sa.BigInteger(), nullable=False),
        sa.Column("reserved_memory", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["parent_id"],
            ["projects.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_projects_parent_id"), ["parent_id"], unique=False)

    op.create_table(
        "api_tokens",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("revoked_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("hash"),
    )
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_tokens_project_id"), ["project_id"], unique=False)

    op.create_table(
        "tasks",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("quota_sandboxes", sa.BigInteger(), nullable=True),
        sa.Column("quota_cpu_m", sa.BigInteger(), nullable=True),
        sa.Column("quota_memory", sa.BigInteger(), nullable=True),
        sa.Column("used_sandboxes", sa.BigInteger(), nullable=False),
        sa.Column("used_cpu_m", sa.BigInteger(), nullable=False),
        sa.Column("used_memory", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("project_id", "name", name="uq_tasks_project_name"),
    )
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_tasks_project_id"), ["project_id"], unique=False)

    op.create_table(
        "sandboxes",
        sa.Column("key", sa.String(length=32), nullable=False),
        sa.Column("id", sa.String(length=63), nullable=True),
        sa.Column("edge_id", sa.String(length=16), nullable=True),
        sa.Column("edge_url", sa.String(length=512), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=True),
        sa.Column("task_name", sa.String(length=63), nullable=True),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("lifecycle", sa.JSON(), nullable=False),
        sa.Column("cpu_m", sa.BigInteger(), nullable=False),
        sa.Column("memory", sa.BigInteger(), nullable=False),
        sa.Column("disk", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=True),
        sa.Column("request_id", sa.String(length=160), nullable=True),
        sa.Column("request_hash", sa.String(length=64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("key"),
        sa.UniqueConstraint("id"),
        sa.UniqueConstraint("project_id", "request_id", name="uq_sandboxes_project_request"),
    )
    with op.batch_alter_table("sandboxes", schema=None) as batch_op:
        batch_op.create_index("ix_sandboxes_edge_state", ["edge_id", "state"], unique=False)
        batch_op.create_index("ix_sandboxes_project_state", ["project_id", "state"], unique=False)
        batch_op.create_index(batch_op.f("ix_sandboxes_state"), ["state"], unique=False)
        batch_op.create_index(batch_op.f("ix_sandboxes_task_id"), ["task_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_sandboxes_updated_at"), ["updated_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("sandboxes", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_sandboxes_updated_at"))
        batch_op.drop_index(batch_op.f("ix_sandboxes_task_id"))
        batch_op.drop_index(batch_op.f("ix_sandboxes_state"))
        batch_op.drop_index("ix_sandboxes_project_state")
        batch_op.drop_index("ix_sandboxes_edge_state")

    op.drop_table("sandboxes")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tasks_project_id"))

    op.drop_table("tasks")
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_tokens_project_id"))

    op.drop_table("api_tokens")
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_projects_parent_id"))

    op.drop_table("projects")
    op.drop_table("leases")
    op.drop_table("edges")
