"""Who asked for each checkpoint: ``checkpoints.requested_by`` (the requesting replica's id) and
``requester_started_at`` (that replica's ``replicas.started_at`` then), so that a pending
checkpoint whose requester is gone (its lease lapsed, or it restarted) is superseded by the next
request at once instead of blocking the run until its deadline. NULL for checkpoints begun
before, and for callers that are no replica: those are never superseded.

Revision ID: 0010_checkpoint_requesters
Revises: 0009_partition_chains
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_checkpoint_requesters"
down_revision: str | None = "0009_partition_chains"
branch_labels: str | None = None
depends_on: str | None = None

NAME = 200


def name() -> sa.types.TypeEngine[str]:
    """A name column's type: bytewise comparison on PostgreSQL, as SQLite's default."""
    return sa.String(NAME).with_variant(sa.String(NAME, collation="C"), "postgresql")


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("requested_by", name(), nullable=True))
    op.add_column("checkpoints", sa.Column("requester_started_at", sa.Double(), nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE … DROP COLUMN (SQLite 3.35+): a batch copy of ``checkpoints`` would
    # have to rebuild its partial unique index of pending checkpoints.
    op.drop_column("checkpoints", "requester_started_at")
    op.drop_column("checkpoints", "requested_by")
