"""Forks: a run created as a branch of another run's committed checkpoint says where it came
from (``runs.forked_from_run``, ``forked_from_checkpoint``), what was asked (``fork_request``:
the fork's request as JSON, so that the same request again finds it) and when it was created
whole (``forked_at``). A fork's row is written first, with ``forked_at`` NULL, to claim the
name; until ``forked_at`` is set the run is being created and nothing else sees it. NULL for
runs that are no fork. A fork's episodes say the attempt they had in the source at the fork
(``episodes.forked_attempt``), for their history.

Who creates a fork: ``runs.fork_claimed_by`` (the replica that claimed the name and copies the
records) and ``fork_claimer_started_at`` (that replica's ``replicas.started_at`` then), so that
two replicas asked for the same fork at once copy it once: the second answers "in progress"
while the first is alive and takes the claim over once it is gone; the fork's commit checks the
claim is still its own. NULL for runs that are no fork, and for forks created whole.

Revision ID: 0012_forks
Revises: 0011_replica_health
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_forks"
down_revision: str | None = "0011_replica_health"
branch_labels: str | None = None
depends_on: str | None = None

NAME = 200


def name() -> sa.types.TypeEngine[str]:
    """A name column's type: bytewise comparison on PostgreSQL, as SQLite's default."""
    return sa.String(NAME).with_variant(sa.String(NAME, collation="C"), "postgresql")


def upgrade() -> None:
    op.add_column("runs", sa.Column("forked_from_run", name(), nullable=True))
    op.add_column("runs", sa.Column("forked_from_checkpoint", sa.BigInteger(), nullable=True))
    op.add_column("runs", sa.Column("forked_at", sa.Double(), nullable=True))
    op.add_column("runs", sa.Column("fork_request", sa.Text(), nullable=True))
    op.add_column("runs", sa.Column("fork_claimed_by", name(), nullable=True))
    op.add_column("runs", sa.Column("fork_claimer_started_at", sa.Double(), nullable=True))
    op.create_index("ix_runs_forked_from_run", "runs", ["forked_from_run"])
    op.add_column("episodes", sa.Column("forked_attempt", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("episodes", "forked_attempt")
    op.drop_index("ix_runs_forked_from_run", "runs")
    op.drop_column("runs", "fork_claimer_started_at")
    op.drop_column("runs", "fork_claimed_by")
    op.drop_column("runs", "fork_request")
    op.drop_column("runs", "forked_at")
    op.drop_column("runs", "forked_from_checkpoint")
    op.drop_column("runs", "forked_from_run")
