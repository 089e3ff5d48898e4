"""Service replicas (issue 17): the replicas' heartbeats, each run partition's owner (a lease
fenced by a generation number), which replica wrote each partition's part of a checkpoint, and
restores planned per partition owner (a request, its parts, its outcome).

Revision ID: 0008_replicas
Revises: 0007_manifest_chains
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_replicas"
down_revision: str | None = "0007_manifest_chains"
branch_labels: str | None = None
depends_on: str | None = None

NAME = 200


def name() -> sa.types.TypeEngine[str]:
    """A name column's type: bytewise comparison on PostgreSQL, as SQLite's default."""
    return sa.String(NAME).with_variant(sa.String(NAME, collation="C"), "postgresql")


def upgrade() -> None:
    op.create_table(
        "replicas",
        sa.Column("replica_id", name(), nullable=False),
        sa.Column("address", sa.Text(), nullable=True),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("heartbeat_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("replica_id", name=op.f("pk_replicas")),
    )
    op.create_table(
        "partition_leases",
        sa.Column("run", name(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("replica_id", name(), nullable=True),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["run"], ["runs.run"], name=op.f("fk_partition_leases_runs")),
        sa.PrimaryKeyConstraint("run", "partition", name=op.f("pk_partition_leases")),
    )
    op.create_table(
        "checkpoint_parts",
        sa.Column("run", name(), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("replica_id", name(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("written_at", sa.Double(), nullable=False),
        sa.Column("totals", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint(
            "run", "checkpoint_id", "partition", name=op.f("pk_checkpoint_parts")
        ),
    )
    op.create_table(
        "restore_requests",
        sa.Column("run", name(), nullable=False),
        sa.Column("restore_id", sa.BigInteger(), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("controller_epoch", sa.BigInteger(), nullable=False),
        sa.Column("requested_by", name(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("request", sa.Text(), nullable=False),
        sa.Column("requested_at", sa.Double(), nullable=False),
        sa.Column("deadline_at", sa.Double(), nullable=False),
        sa.Column("ended_at", sa.Double(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "status IN ('planning', 'committed', 'aborted')",
            name=op.f("ck_restore_requests_status_known"),
        ),
        sa.ForeignKeyConstraint(["run"], ["runs.run"], name=op.f("fk_restore_requests_runs")),
        sa.PrimaryKeyConstraint("run", "restore_id", name=op.f("pk_restore_requests")),
    )
    op.create_table(
        "restore_parts",
        sa.Column("run", name(), nullable=False),
        sa.Column("restore_id", sa.BigInteger(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("replica_id", name(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("written_at", sa.Double(), nullable=False),
        sa.Column("entries", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("run", "restore_id", "partition", name=op.f("pk_restore_parts")),
    )


def downgrade() -> None:
    op.drop_table("restore_parts")
    op.drop_table("restore_requests")
    op.drop_table("checkpoint_parts")
    op.drop_table("partition_leases")
    op.drop_table("replicas")
