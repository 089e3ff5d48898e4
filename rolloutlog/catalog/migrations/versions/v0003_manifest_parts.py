"""Manifests as one packed row per partition (``manifest_parts``); ``manifest_entries`` becomes a
view over it with the same columns, so analysts' SQL reads the same rows.

Revision ID: 0003_manifest_parts
Revises: 0002_restores_episodes
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import orjson
import sqlalchemy as sa
from alembic import op

revision = "0003_manifest_parts"
down_revision: str | None = "0002_restores_episodes"
branch_labels: str | None = None
depends_on: str | None = None

NAME = 200

# Frozen copies of the schema module's view definitions at this revision.
VIEW = {
    "sqlite": (
        "CREATE VIEW manifest_entries AS SELECT p.run AS run, p.checkpoint_id AS checkpoint_id, "
        "json_extract(e.value, '$[0]') AS episode, json_extract(e.value, '$[1]') AS attempt, "
        "json_extract(e.value, '$[2]') AS action, p.cut_partition AS cut_partition, "
        "json_extract(e.value, '$[4]') AS cut_offset, json_extract(e.value, '$[5]') AS last_stage, "
        "CASE WHEN json_array_length(e.value, '$[6]') > 0 THEN json_extract(e.value, '$[6]') END "
        "AS staging_keys, json_extract(e.value, '$[7]') AS size_bytes "
        "FROM manifest_parts AS p, json_each(p.entries) AS e"
    ),
    "postgresql": (
        "CREATE VIEW manifest_entries AS SELECT p.run AS run, p.checkpoint_id AS checkpoint_id, "
        'CAST(e.value ->> 0 AS VARCHAR(200)) COLLATE "C" AS episode, '
        "CAST(e.value ->> 1 AS INTEGER) AS attempt, CAST(e.value ->> 2 AS VARCHAR(16)) AS action, "
        "p.cut_partition AS cut_partition, CAST(e.value ->> 4 AS BIGINT) AS cut_offset, "
        "e.value ->> 5 AS last_stage, "
        "CASE WHEN json_array_length(e.value -> 6) > 0 THEN CAST(e.value -> 6 AS TEXT) END "
        "AS staging_keys, CAST(e.value ->> 7 AS BIGINT) AS size_bytes "
        "FROM manifest_parts AS p CROSS JOIN LATERAL json_array_elements(CAST(p.entries AS JSON)) "
        "AS e(value)"
    ),
}

ENTRY_COLUMNS = (
    "episode",
    "attempt",
    "action",
    "cut_partition",
    "cut_offset",
    "last_stage",
    "staging_keys",
    "size_bytes",
)


def name() -> sa.types.TypeEngine[str]:
    """A name column's type: bytewise comparison on PostgreSQL, as SQLite's default."""
    return sa.String(NAME).with_variant(sa.String(NAME, collation="C"), "postgresql")


def _entries_table() -> sa.Table:
    return sa.Table(
        "manifest_entries",
        sa.MetaData(),
        sa.Column("run", name()),
        sa.Column("checkpoint_id", sa.BigInteger()),
        sa.Column("episode", name()),
        sa.Column("attempt", sa.Integer()),
        sa.Column("action", sa.String(16)),
        sa.Column("cut_partition", sa.Integer()),
        sa.Column("cut_offset", sa.BigInteger()),
        sa.Column("last_stage", sa.Text()),
        sa.Column("staging_keys", sa.Text()),
        sa.Column("size_bytes", sa.BigInteger()),
    )


def _parts_table() -> sa.Table:
    return sa.Table(
        "manifest_parts",
        sa.MetaData(),
        sa.Column("run", name()),
        sa.Column("checkpoint_id", sa.BigInteger()),
        sa.Column("cut_partition", sa.Integer()),
        sa.Column("entries", sa.Text()),
        sa.Column("entry_count", sa.Integer()),
    )


def upgrade() -> None:
    op.create_table(
        "manifest_parts",
        sa.Column("run", name(), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("cut_partition", sa.Integer(), nullable=False),
        sa.Column("entries", sa.Text(), nullable=False),
        sa.Column("entry_count", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint(
            "run", "checkpoint_id", "cut_partition", name=op.f("pk_manifest_parts")
        ),
        sqlite_with_rowid=False,
    )
    bind = op.get_bind()
    old = _entries_table()
    parts: dict[tuple[str, int, int], list[list[Any]]] = defaultdict(list)
    for row in bind.execute(sa.select(old).order_by(old.c.episode)):
        keys = orjson.loads(row.staging_keys) if row.staging_keys is not None else []
        parts[(row.run, row.checkpoint_id, row.cut_partition)].append(
            [
                row.episode,
                row.attempt,
                row.action,
                row.cut_partition,
                row.cut_offset,
                row.last_stage,
                keys,
                row.size_bytes,
            ]
        )
    if parts:
        bind.execute(
            sa.insert(_parts_table()),
            [
                {
                    "run": run,
                    "checkpoint_id": checkpoint_id,
                    "cut_partition": partition,
                    "entries": orjson.dumps(entries).decode(),
                    "entry_count": len(entries),
                }
                for (run, checkpoint_id, partition), entries in parts.items()
            ],
        )
    op.drop_table("manifest_entries")
    op.execute(VIEW[bind.dialect.name])


def downgrade() -> None:
    bind = op.get_bind()
    op.execute("DROP VIEW manifest_entries")
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
    parts = _parts_table()
    rows = []
    for part in bind.execute(sa.select(parts)):
        for entry in orjson.loads(part.entries):
            values = dict(zip(ENTRY_COLUMNS, entry, strict=True))
            keys = values["staging_keys"]
            values["staging_keys"] = orjson.dumps(keys).decode() if keys else None
            rows.append({"run": part.run, "checkpoint_id": part.checkpoint_id, **values})
    if rows:
        bind.execute(sa.insert(_entries_table()), rows)
    op.drop_table("manifest_parts")
