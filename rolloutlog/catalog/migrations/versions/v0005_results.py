"""Finished episodes' results (reward and opaque result, copied from their ``episode.finished``
records) and the trainer's acknowledgement of each.

Revision ID: 0005_results
Revises: 0004_quarantine
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_results"
down_revision: str | None = "0004_quarantine"
branch_labels: str | None = None
depends_on: str | None = None

NAME = 200


def name() -> sa.types.TypeEngine[str]:
    """A name column's type: bytewise comparison on PostgreSQL, as SQLite's default."""
    return sa.String(NAME).with_variant(sa.String(NAME, collation="C"), "postgresql")


def upgrade() -> None:
    op.create_table(
        "results",
        sa.Column("run", name(), nullable=False),
        sa.Column("episode", name(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("finished_offset", sa.BigInteger(), nullable=False),
        sa.Column("ts", sa.Double(), nullable=False),
        sa.Column("reward", sa.Double(), nullable=True),
        sa.Column("result", sa.Text(), nullable=True),
        sa.Column("recorded_at", sa.Double(), nullable=False),
        sa.Column("acknowledged_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["run"], ["runs.run"], name=op.f("fk_results_runs")),
        sa.PrimaryKeyConstraint("run", "episode", name=op.f("pk_results")),
    )
    op.create_index(
        "ix_results_unacknowledged",
        "results",
        ["run", "episode"],
        sqlite_where=sa.text("acknowledged_at IS NULL"),
        postgresql_where=sa.text("acknowledged_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_results_unacknowledged", table_name="results")
    op.drop_table("results")
