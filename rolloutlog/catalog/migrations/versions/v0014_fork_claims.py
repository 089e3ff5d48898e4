"""Who creates a fork: ``runs.fork_claimed_by`` (the replica that claimed the fork's name and
copies its records) and ``fork_claimer_started_at`` (that replica's ``replicas.started_at``
then), so that two replicas asked for the same fork at once copy it once: the second answers
"in progress" while the first is alive (its heartbeat current, the same process), and takes the
claim over (drops the partial copy, copies afresh) once it is gone. The fork's commit checks the
claim is still its own. NULL for runs that are no fork, and for forks created whole.

Revision ID: 0014_fork_claims
Revises: 0012_forks
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_fork_claims"
down_revision: str | None = "0012_forks"
branch_labels: str | None = None
depends_on: str | None = None

NAME = 200


def name() -> sa.types.TypeEngine[str]:
    """A name column's type: bytewise comparison on PostgreSQL, as SQLite's default."""
    return sa.String(NAME).with_variant(sa.String(NAME, collation="C"), "postgresql")


def upgrade() -> None:
    op.add_column("runs", sa.Column("fork_claimed_by", name(), nullable=True))
    op.add_column("runs", sa.Column("fork_claimer_started_at", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "fork_claimer_started_at")
    op.drop_column("runs", "fork_claimed_by")
