"""Incremental manifests: a checkpoint's parts may hold only what changed since an earlier
committed checkpoint (and ``removed`` tombstones); ``manifest_chain`` lists, per retained
checkpoint, the checkpoints whose parts compose its manifest, and the ``manifest_entries`` view
composes them (the same columns and rows as before for analysts' SQL).

Revision ID: 0007_manifest_chains
Revises: 0006_manifest_reasons
Create Date: 2026-11-30
"""

from __future__ import annotations

from typing import Any

import orjson
import sqlalchemy as sa
from alembic import op

revision = "0007_manifest_chains"
down_revision: str | None = "0006_manifest_reasons"
branch_labels: str | None = None
depends_on: str | None = None

NAME = 200

# Frozen copies of the schema module's view definitions at this revision (and the one before).
_FIELDS = {
    "sqlite": (
        "json_extract(e.value, '$[0]') AS episode, json_extract(e.value, '$[1]') AS attempt, "
        "json_extract(e.value, '$[2]') AS action, p.cut_partition AS cut_partition, "
        "json_extract(e.value, '$[4]') AS cut_offset, json_extract(e.value, '$[5]') AS last_stage, "
        "CASE WHEN json_array_length(e.value, '$[6]') > 0 THEN json_extract(e.value, '$[6]') END "
        "AS staging_keys, json_extract(e.value, '$[7]') AS size_bytes, "
        "json_extract(e.value, '$[8]') AS reason"
    ),
    "postgresql": (
        'CAST(e.value ->> 0 AS VARCHAR(200)) COLLATE "C" AS episode, '
        "CAST(e.value ->> 1 AS INTEGER) AS attempt, CAST(e.value ->> 2 AS VARCHAR(16)) AS action, "
        "p.cut_partition AS cut_partition, CAST(e.value ->> 4 AS BIGINT) AS cut_offset, "
        "e.value ->> 5 AS last_stage, "
        "CASE WHEN json_array_length(e.value -> 6) > 0 THEN CAST(e.value -> 6 AS TEXT) END "
        "AS staging_keys, CAST(e.value ->> 7 AS BIGINT) AS size_bytes, "
        "e.value ->> 8 AS reason"
    ),
}
_EXPAND = {
    "sqlite": "json_each(p.entries) AS e",
    "postgresql": "LATERAL json_array_elements(CAST(p.entries AS JSON)) AS e(value)",
}
_COLUMNS = (
    "run, checkpoint_id, episode, attempt, action, cut_partition, cut_offset, last_stage, "
    "staging_keys, size_bytes, reason"
)
VIEW = {
    dialect: (
        f"CREATE VIEW manifest_entries AS SELECT {_COLUMNS} FROM (SELECT c.run AS run, "
        f"c.checkpoint_id AS checkpoint_id, {fields}, row_number() OVER (PARTITION BY c.run, "
        "c.checkpoint_id, p.cut_partition, "
        + ("json_extract(e.value, '$[0]')" if dialect == "sqlite" else "e.value ->> 0")
        + " ORDER BY c.depth) AS newest FROM manifest_chain AS c JOIN manifest_parts AS p ON "
        f"p.run = c.run AND p.checkpoint_id = c.ancestor_id CROSS JOIN {_EXPAND[dialect]}) "
        "AS m WHERE newest = 1 AND action <> 'removed'"
    )
    for dialect, fields in _FIELDS.items()
}
PREVIOUS_VIEW = {
    dialect: (
        "CREATE VIEW manifest_entries AS SELECT p.run AS run, p.checkpoint_id AS checkpoint_id, "
        f"{fields} FROM manifest_parts AS p"
        + (
            ", json_each(p.entries) AS e"
            if dialect == "sqlite"
            else f" CROSS JOIN {_EXPAND[dialect]}"
        )
    )
    for dialect, fields in _FIELDS.items()
}


def name() -> sa.types.TypeEngine[str]:
    """A name column's type: bytewise comparison on PostgreSQL, as SQLite's default."""
    return sa.String(NAME).with_variant(sa.String(NAME, collation="C"), "postgresql")


_parts = sa.table(
    "manifest_parts",
    sa.column("run"),
    sa.column("checkpoint_id"),
    sa.column("cut_partition"),
    sa.column("entries"),
    sa.column("entry_count"),
)
_chain = sa.table(
    "manifest_chain",
    sa.column("run"),
    sa.column("checkpoint_id"),
    sa.column("depth"),
    sa.column("ancestor_id"),
)


def upgrade() -> None:
    op.create_table(
        "manifest_chain",
        sa.Column("run", name(), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.Column("ancestor_id", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run", "checkpoint_id", "depth", name=op.f("pk_manifest_chain")),
        sqlite_with_rowid=False,
    )
    # Every manifest so far is whole: a chain of itself.
    bind = op.get_bind()
    bind.execute(
        sa.insert(_chain).from_select(
            ["run", "checkpoint_id", "depth", "ancestor_id"],
            sa.select(
                _parts.c.run, _parts.c.checkpoint_id, sa.literal(0), _parts.c.checkpoint_id
            ).distinct(),
        )
    )
    op.execute("DROP VIEW manifest_entries")
    op.execute(VIEW[bind.dialect.name])


def downgrade() -> None:
    # The older revision reads each checkpoint's parts alone: write every retained delta's
    # manifest whole, and drop parts no retained checkpoint is made of any more.
    bind = op.get_bind()
    chains: dict[tuple[str, int], list[int]] = {}
    for row in bind.execute(sa.select(_chain).order_by(_chain.c.depth)).all():
        chains.setdefault((row.run, row.checkpoint_id), []).append(row.ancestor_id)
    # Composed from the parts as they are, before any is rewritten (a chain reads its members').
    whole: dict[tuple[str, int], dict[int, dict[str, list[Any]]]] = {}
    for (run, checkpoint_id), ancestors in chains.items():
        if len(ancestors) == 1:
            continue
        composed: dict[int, dict[str, list[Any]]] = {}
        for ancestor in reversed(ancestors):
            for part in bind.execute(
                sa.select(_parts.c.cut_partition, _parts.c.entries).where(
                    _parts.c.run == run, _parts.c.checkpoint_id == ancestor
                )
            ).all():
                into = composed.setdefault(part.cut_partition, {})
                for entry in orjson.loads(part.entries):
                    into[entry[0]] = entry
        whole[(run, checkpoint_id)] = composed
    for (run, checkpoint_id), composed in whole.items():
        bind.execute(
            sa.delete(_parts).where(_parts.c.run == run, _parts.c.checkpoint_id == checkpoint_id)
        )
        rows = []
        for partition, by_episode in sorted(composed.items()):
            kept = [by_episode[e] for e in sorted(by_episode) if by_episode[e][2] != "removed"]
            if kept:
                rows.append(
                    {
                        "run": run,
                        "checkpoint_id": checkpoint_id,
                        "cut_partition": partition,
                        "entries": orjson.dumps(kept).decode(),
                        "entry_count": len(kept),
                    }
                )
        if rows:
            bind.execute(sa.insert(_parts), rows)
    retained = set(chains)
    for row in bind.execute(sa.select(_parts.c.run, _parts.c.checkpoint_id).distinct()).all():
        if (row.run, row.checkpoint_id) not in retained:
            bind.execute(
                sa.delete(_parts).where(
                    _parts.c.run == row.run, _parts.c.checkpoint_id == row.checkpoint_id
                )
            )
    op.execute("DROP VIEW manifest_entries")
    op.execute(PREVIOUS_VIEW[bind.dialect.name])
    op.drop_table("manifest_chain")
