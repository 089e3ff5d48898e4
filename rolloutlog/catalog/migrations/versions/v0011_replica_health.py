"""Replica health (cross-replica health): each replica's heartbeat also writes how its projectors
are doing per run and partition it owns (a JSON report in ``replicas.health``), so that every
replica can say which partition and which replica hold a run back.

Revision ID: 0011_replica_health
Revises: 0010_checkpoint_requesters
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_replica_health"
down_revision: str | None = "0010_checkpoint_requesters"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.add_column(sa.Column("health", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.drop_column("health")
