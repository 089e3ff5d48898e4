"""Core tables: runs, participants, checkpoints, checkpoint offsets, manifest entries.

Revision ID: 0001_core
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_core"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

NAME = 200


def name() -> sa.types.TypeEngine[str]:
    """A name column's type: bytewise comparison on PostgreSQL, as SQLite's default."""
    return sa.String(NAME).with_variant(sa.String(NAME, collation="C"), "postgresql")


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("run", name(), nullable=False),
        sa.Column("partitions", sa.Integer(), nullable=False),
        sa.Column("log_url", sa.Text(), nullable=True),
        sa.Column("controller_epoch", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("latest_checkpoint_id", sa.BigInteger(), nullable=True),
        sa.Column(
            "last_checkpoint_id", sa.BigInteger(), server_default=sa.text("0"), nullable=False
        ),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.CheckConstraint("partitions >= 1", name=op.f("ck_runs_partitions_positive")),
        sa.PrimaryKeyConstraint("run", name=op.f("pk_runs")),
    )
    op.create_table(
        "participants",
        sa.Column("run", name(), nullable=False),
        sa.Column("participant_id", name(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("registered_at", sa.Double(), nullable=False),
        sa.Column("last_seen_at", sa.Double(), nullable=False),
        sa.CheckConstraint(
            "kind IN ('environment', 'policy', 'agent', 'resources')",
            name=op.f("ck_participants_kind_known"),
        ),
        sa.ForeignKeyConstraint(["run"], ["runs.run"], name=op.f("fk_participants_runs")),
        sa.PrimaryKeyConstraint("run", "participant_id", name=op.f("pk_participants")),
    )
    op.create_table(
        "checkpoints",
        sa.Column("run", name(), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("trigger", sa.String(64), nullable=False),
        sa.Column("controller_epoch", sa.BigInteger(), nullable=False),
        sa.Column("deadline_s", sa.Double(), nullable=True),
        sa.Column("requested_at", sa.Double(), nullable=False),
        sa.Column("marked_at", sa.Double(), nullable=True),
        sa.Column("committed_at", sa.Double(), nullable=True),
        sa.Column("ended_at", sa.Double(), nullable=True),
        sa.Column("continue_count", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("restart_count", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("finished_count", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("entry_count", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("timings_ms", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'committed', 'aborted', 'expired')",
            name=op.f("ck_checkpoints_status_known"),
        ),
        sa.ForeignKeyConstraint(["run"], ["runs.run"], name=op.f("fk_checkpoints_runs")),
        sa.PrimaryKeyConstraint("run", "checkpoint_id", name=op.f("pk_checkpoints")),
    )
    op.create_index(
        "uq_checkpoints_one_pending",
        "checkpoints",
        ["run"],
        unique=True,
        sqlite_where=sa.text("status = 'pending'"),
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.create_table(
        "checkpoint_offsets",
        sa.Column("run", name(), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("marker_offset", sa.BigInteger(), nullable=False),
        sa.Column("replay_from", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run", "checkpoint_id"],
            ["checkpoints.run", "checkpoints.checkpoint_id"],
            name=op.f("fk_checkpoint_offsets_checkpoints"),
        ),
        sa.PrimaryKeyConstraint(
            "run", "checkpoint_id", "partition", name=op.f("pk_checkpoint_offsets")
        ),
    )
    op.create_table(
        "manifest_entries",
        sa.Column("run", name(), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("episode", name(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("cut_partition", sa.Integer(), nullable=False),
        sa.Column("cut_offset", sa.BigInteger(), nullable=False),
        sa.Column("last_stage", sa.Text(), nullable=True),
        sa.Column("staging_keys", sa.Text(), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(
            "run", "checkpoint_id", "episode", name=op.f("pk_manifest_entries")
        ),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("manifest_entries")
    op.drop_table("checkpoint_offsets")
    op.drop_index("uq_checkpoints_one_pending", table_name="checkpoints")
    op.drop_table("checkpoints")
    op.drop_table("participants")
    op.drop_table("runs")
