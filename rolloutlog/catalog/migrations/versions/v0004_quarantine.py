"""Quarantined log records: records the projector skipped (not a valid envelope, or the fold could
not apply them), with where they are and why.

Revision ID: 0004_quarantine
Revises: 0003_manifest_parts
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_quarantine"
down_revision: str | None = "0003_manifest_parts"
branch_labels: str | None = None
depends_on: str | None = None

NAME = 200


def name() -> sa.types.TypeEngine[str]:
    """A name column's type: bytewise comparison on PostgreSQL, as SQLite's default."""
    return sa.String(NAME).with_variant(sa.String(NAME, collation="C"), "postgresql")


def upgrade() -> None:
    op.create_table(
        "quarantined_records",
        sa.Column("run", name(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("first_bytes", sa.LargeBinary(), nullable=False),
        sa.Column("recorded_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("run", "partition", "offset", name=op.f("pk_quarantined_records")),
    )


def downgrade() -> None:
    op.drop_table("quarantined_records")
