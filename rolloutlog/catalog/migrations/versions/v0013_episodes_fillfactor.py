"""On PostgreSQL, ``episodes`` pages keep 30% free (``fillfactor = 70``): a restore moves every
continued episode's ``current_attempt`` in one ``UPDATE … FROM restore_episodes``, and with room
on its page PostgreSQL writes each new row version there without a new entry in either index
(a heap-only update; neither ``current_attempt`` nor ``updated_at`` is indexed). Measured on
16,000 episodes, the same statement on this machine: 150-190 ms at the default fillfactor (100),
75-136 ms at 70. Pages written before this revision fill up to 100% until they are rewritten
(``VACUUM FULL episodes``, or as rows move). SQLite has no such setting: nothing changes there.

Revision ID: 0013_episodes_fillfactor
Revises: 0012_forks
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0013_episodes_fillfactor"
down_revision: str | None = "0012_forks"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE episodes SET (fillfactor = 70)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE episodes RESET (fillfactor)")
