"""Manifest chains per partition (issue 17): a checkpoint's partitions may be written by different
replicas, each part whole or a delta of its own base, so ``manifest_chain`` gets a ``partition``
column (a chain per partition; existing chains hold for every partition of their run), the
``manifest_entries`` view joins a part to its partition's chain (same columns), and
``checkpoint_parts`` records each part's base.

Revision ID: 0009_partition_chains
Revises: 0008_replicas
Create Date: 2026-11-30
"""

from __future__ import annotations

from typing import Any

import orjson
import sqlalchemy as sa
from alembic import op

revision = "0009_partition_chains"
down_revision: str | None = "0008_replicas"
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


def _view(dialect: str, per_partition: bool) -> str:
    joined = " AND p.cut_partition = c.partition" if per_partition else ""
    return (
        f"CREATE VIEW manifest_entries AS SELECT {_COLUMNS} FROM (SELECT c.run AS run, "
        f"c.checkpoint_id AS checkpoint_id, {_FIELDS[dialect]}, row_number() OVER (PARTITION BY "
        "c.run, c.checkpoint_id, p.cut_partition, "
        + ("json_extract(e.value, '$[0]')" if dialect == "sqlite" else "e.value ->> 0")
        + " ORDER BY c.depth) AS newest FROM manifest_chain AS c JOIN manifest_parts AS p ON "
        f"p.run = c.run AND p.checkpoint_id = c.ancestor_id{joined} "
        f"CROSS JOIN {_EXPAND[dialect]}) AS m WHERE newest = 1 AND action <> 'removed'"
    )


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
_runs = sa.table("runs", sa.column("run"), sa.column("partitions"))


def _chain_table(per_partition: bool) -> None:
    columns: list[Any] = [
        sa.Column("run", name(), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger(), nullable=False),
    ]
    key = ["run", "checkpoint_id"]
    if per_partition:
        columns.append(sa.Column("partition", sa.Integer(), nullable=False))
        key.append("partition")
    op.create_table(
        "manifest_chain",
        *columns,
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.Column("ancestor_id", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(*key, "depth", name=op.f("pk_manifest_chain")),
        sqlite_with_rowid=False,
    )


def upgrade() -> None:
    bind = op.get_bind()
    old = sa.table(
        "manifest_chain",
        sa.column("run"),
        sa.column("checkpoint_id"),
        sa.column("depth"),
        sa.column("ancestor_id"),
    )
    rows = bind.execute(sa.select(old)).all()
    partitions = dict(bind.execute(sa.select(_runs.c.run, _runs.c.partitions)).all())
    op.execute("DROP VIEW manifest_entries")
    op.drop_table("manifest_chain")
    _chain_table(per_partition=True)
    # Every chain so far is the same for every partition of its run.
    new = sa.table(
        "manifest_chain",
        sa.column("run"),
        sa.column("checkpoint_id"),
        sa.column("partition"),
        sa.column("depth"),
        sa.column("ancestor_id"),
    )
    expanded = [
        {
            "run": row.run,
            "checkpoint_id": row.checkpoint_id,
            "partition": partition,
            "depth": row.depth,
            "ancestor_id": row.ancestor_id,
        }
        for row in rows
        for partition in range(partitions.get(row.run, 0))
    ]
    if expanded:
        bind.execute(sa.insert(new), expanded)
    op.add_column("checkpoint_parts", sa.Column("base_checkpoint_id", sa.BigInteger()))
    op.execute(_view(bind.dialect.name, per_partition=True))


def downgrade() -> None:
    # The older revision has one chain per checkpoint: a checkpoint whose partitions' chains
    # all name the same checkpoints keeps it; if any does not, every chained manifest is written
    # whole (composed before any part is rewritten: a chain reads its members' parts).
    bind = op.get_bind()
    new = sa.table(
        "manifest_chain",
        sa.column("run"),
        sa.column("checkpoint_id"),
        sa.column("partition"),
        sa.column("depth"),
        sa.column("ancestor_id"),
    )
    chains: dict[tuple[str, int], dict[int, list[int]]] = {}
    for row in bind.execute(sa.select(new).order_by(new.c.depth)).all():
        by_partition = chains.setdefault((row.run, row.checkpoint_id), {})
        by_partition.setdefault(row.partition, []).append(row.ancestor_id)
    uniform = all(len({tuple(c) for c in p.values()}) == 1 for p in chains.values())
    kept: dict[tuple[str, int], list[int]] = {}
    whole: dict[tuple[str, int], dict[int, dict[str, list[Any]]]] = {}
    for (run, checkpoint_id), by_partition in chains.items():
        longest = max(by_partition.values(), key=len)
        if uniform or len(longest) == 1:
            kept[(run, checkpoint_id)] = longest
            continue
        kept[(run, checkpoint_id)] = [checkpoint_id]
        composed: dict[int, dict[str, list[Any]]] = {}
        for partition, ancestors in by_partition.items():
            into = composed.setdefault(partition, {})
            for ancestor in reversed(ancestors):
                for (body,) in bind.execute(
                    sa.select(_parts.c.entries).where(
                        _parts.c.run == run,
                        _parts.c.checkpoint_id == ancestor,
                        _parts.c.cut_partition == partition,
                    )
                ).all():
                    for entry in orjson.loads(body):
                        into[entry[0]] = entry
        whole[(run, checkpoint_id)] = composed
    for (run, checkpoint_id), composed in whole.items():
        bind.execute(
            sa.delete(_parts).where(_parts.c.run == run, _parts.c.checkpoint_id == checkpoint_id)
        )
        rows = []
        for partition, by_episode in sorted(composed.items()):
            live = [by_episode[e] for e in sorted(by_episode) if by_episode[e][2] != "removed"]
            if live:
                rows.append(
                    {
                        "run": run,
                        "checkpoint_id": checkpoint_id,
                        "cut_partition": partition,
                        "entries": orjson.dumps(live).decode(),
                        "entry_count": len(live),
                    }
                )
        if rows:
            bind.execute(sa.insert(_parts), rows)
    for row in bind.execute(sa.select(_parts.c.run, _parts.c.checkpoint_id).distinct()).all():
        named = any(
            row.checkpoint_id in ancestors for (run, _), ancestors in kept.items() if run == row.run
        )
        if not named:
            bind.execute(
                sa.delete(_parts).where(
                    _parts.c.run == row.run, _parts.c.checkpoint_id == row.checkpoint_id
                )
            )
    op.execute("DROP VIEW manifest_entries")
    op.drop_table("manifest_chain")
    _chain_table(per_partition=False)
    old = sa.table(
        "manifest_chain",
        sa.column("run"),
        sa.column("checkpoint_id"),
        sa.column("depth"),
        sa.column("ancestor_id"),
    )
    flat = [
        {"run": run, "checkpoint_id": checkpoint_id, "depth": depth, "ancestor_id": ancestor}
        for (run, checkpoint_id), ancestors in kept.items()
        for depth, ancestor in enumerate(ancestors)
    ]
    if flat:
        bind.execute(sa.insert(old), flat)
    with op.batch_alter_table("checkpoint_parts") as batch:
        batch.drop_column("base_checkpoint_id")
    op.execute(_view(bind.dialect.name, per_partition=False))
