"""Manifest entries say why an episode restarts: a ninth element of each packed entry, and a
``reason`` column of the ``manifest_entries`` view (NULL for entries written before).

Revision ID: 0006_manifest_reasons
Revises: 0004_quarantine
Create Date: 2026-11-30
"""

from __future__ import annotations

import orjson
import sqlalchemy as sa
from alembic import op

revision = "0006_manifest_reasons"
# 0005 is res18's (results), on another branch: when both are merged this says "0005_results".
down_revision: str | None = "0004_quarantine"
branch_labels: str | None = None
depends_on: str | None = None

# Frozen copies of the schema module's view definitions at this revision (and the one before).
VIEW = {
    "sqlite": (
        "CREATE VIEW manifest_entries AS SELECT p.run AS run, p.checkpoint_id AS checkpoint_id, "
        "json_extract(e.value, '$[0]') AS episode, json_extract(e.value, '$[1]') AS attempt, "
        "json_extract(e.value, '$[2]') AS action, p.cut_partition AS cut_partition, "
        "json_extract(e.value, '$[4]') AS cut_offset, json_extract(e.value, '$[5]') AS last_stage, "
        "CASE WHEN json_array_length(e.value, '$[6]') > 0 THEN json_extract(e.value, '$[6]') END "
        "AS staging_keys, json_extract(e.value, '$[7]') AS size_bytes, "
        "json_extract(e.value, '$[8]') AS reason "
        "FROM manifest_parts AS p, json_each(p.entries) AS e"
    ),
    "postgresql": (
        "CREATE VIEW manifest_entries AS SELECT p.run AS run, p.checkpoint_id AS checkpoint_id, "
        'CAST(e.value ->> 0 AS VARCHAR(200)) COLLATE "C" AS episode, '
        "CAST(e.value ->> 1 AS INTEGER) AS attempt, CAST(e.value ->> 2 AS VARCHAR(16)) AS action, "
        "p.cut_partition AS cut_partition, CAST(e.value ->> 4 AS BIGINT) AS cut_offset, "
        "e.value ->> 5 AS last_stage, "
        "CASE WHEN json_array_length(e.value -> 6) > 0 THEN CAST(e.value -> 6 AS TEXT) END "
        "AS staging_keys, CAST(e.value ->> 7 AS BIGINT) AS size_bytes, "
        "e.value ->> 8 AS reason "
        "FROM manifest_parts AS p CROSS JOIN LATERAL json_array_elements(CAST(p.entries AS JSON)) "
        "AS e(value)"
    ),
}
PREVIOUS_VIEW = {
    dialect: view.replace(", json_extract(e.value, '$[8]') AS reason ", " ").replace(
        ", e.value ->> 8 AS reason ", " "
    )
    for dialect, view in VIEW.items()
}


def upgrade() -> None:
    op.execute("DROP VIEW manifest_entries")
    op.execute(VIEW[op.get_bind().dialect.name])


def downgrade() -> None:
    # The older revision's entries have eight elements (0003's downgrade zips them strictly).
    bind = op.get_bind()
    parts = sa.table(
        "manifest_parts",
        sa.column("run"),
        sa.column("checkpoint_id"),
        sa.column("cut_partition"),
        sa.column("entries"),
    )
    for part in bind.execute(sa.select(parts)).all():
        entries = orjson.loads(part.entries)
        if any(len(entry) > 8 for entry in entries):
            bind.execute(
                sa.update(parts)
                .where(
                    parts.c.run == part.run,
                    parts.c.checkpoint_id == part.checkpoint_id,
                    parts.c.cut_partition == part.cut_partition,
                )
                .values(entries=orjson.dumps([entry[:8] for entry in entries]).decode())
            )
    op.execute("DROP VIEW manifest_entries")
    op.execute(PREVIOUS_VIEW[bind.dialect.name])
