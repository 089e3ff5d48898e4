"""Restores, restore episodes and the episodes table; restore id counter on runs.

Revision ID: 0002_restores_episodes
Revises: 0001_core
Create Date: 2025-01-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_restores_episodes"
down_revision: str | None = "0001_core"
branch_labels: str | None = None
depends_on: str | None = None

NAME = 200


def name() -> sa.types.TypeEngine[str]:
    """A name column's type: bytewise comparison on PostgreSQL, as SQLite's default."""
    return sa.String(NAME).with_variant(sa.String(NAME, collation="C"), "postgresql")


def upgrade() -> None:
    op.add_column(
        "runs",
        sa.Column("last_restore_id", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    )
    op.create_table(
        "restores",
        sa.Column("run", name(), nullable=False),
        sa.Column("restore_id", sa.BigInteger(), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("controller_epoch", sa.BigInteger(), nullable=False),
        sa.Column("committed_at", sa.Double(), nullable=False),
        sa.Column("continue_count", sa.Integer(), nullable=False),
        sa.Column("restart_count", sa.Integer(), nullable=False),
        sa.Column("excluded_count", sa.Integer(), nullable=False),
        sa.Column("timings_ms", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run", "checkpoint_id"],
            ["checkpoints.run", "checkpoints.checkpoint_id"],
            name=op.f("fk_restores_checkpoints"),
        ),
        sa.PrimaryKeyConstraint("run", "restore_id", name=op.f("pk_restores")),
    )
    op.create_table(
        "restore_episodes",
        sa.Column("run", name(), nullable=False),
        sa.Column("restore_id", sa.BigInteger(), nullable=False),
        sa.Column("episode", name(), nullable=False),
        sa.Column("previous_attempt", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("capture_key", sa.String(NAME + 16), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("run", "restore_id", "episode", name=op.f("pk_restore_episodes")),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "episodes",
        sa.Column("run", name(), nullable=False),
        sa.Column("episode", name(), nullable=False),
        sa.Column("current_attempt", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("first_partition", sa.Integer(), nullable=True),
        sa.Column("first_offset", sa.BigInteger(), nullable=True),
        sa.Column("started_at", sa.Double(), nullable=True),
        sa.Column("finished_at", sa.Double(), nullable=True),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.CheckConstraint(
            "status IN ('running', 'finished', 'excluded')",
            name=op.f("ck_episodes_status_known"),
        ),
        sa.ForeignKeyConstraint(["run"], ["runs.run"], name=op.f("fk_episodes_runs")),
        sa.PrimaryKeyConstraint("run", "episode", name=op.f("pk_episodes")),
    )
    op.create_index(
        "ix_episodes_run_status_episode", "episodes", ["run", "status", "episode"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_episodes_run_status_episode", table_name="episodes")
    op.drop_table("episodes")
    op.drop_table("restore_episodes")
    op.drop_table("restores")
    op.drop_column("runs", "last_restore_id")
