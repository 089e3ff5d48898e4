"""The catalog's schema: SQLAlchemy Core tables on one ``MetaData``.

This module is the single source of truth for table and column names; the Alembic migrations in
``migrations/versions`` create exactly these tables (a test compares the two). Times are UNIX
epoch seconds (``DOUBLE PRECISION``/``REAL``) so they read the same on SQLite and PostgreSQL; small
structured values (staging keys, timings) are JSON text for the same reason. ``docs/catalog.md``
documents the schema for analysts.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    Double,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    text,
)

VERSION_TABLE = "catalog_version"
"""Alembic's version table (one row: the schema revision the catalog is at)."""

NAME_LENGTH = 200

Name = String(NAME_LENGTH).with_variant(String(NAME_LENGTH, collation="C"), "postgresql")
"""Run, participant and episode names. On PostgreSQL they compare bytewise (``COLLATE "C"``), as
SQLite's default BINARY collation does, so keyset pages come in the same order on both and the
hot primary-key indexes avoid locale-aware comparisons."""

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

runs = Table(
    "runs",
    metadata,
    Column("run", Name, primary_key=True),
    Column("partitions", Integer, nullable=False),
    Column("log_url", Text, nullable=True),
    Column("controller_epoch", BigInteger, nullable=False, server_default=text("0")),
    Column("latest_checkpoint_id", BigInteger, nullable=True),
    # Counters that make checkpoint and restore ids strictly increasing per run, never reused.
    Column("last_checkpoint_id", BigInteger, nullable=False, server_default=text("0")),
    Column("last_restore_id", BigInteger, nullable=False, server_default=text("0")),
    Column("created_at", Double, nullable=False),
    CheckConstraint("partitions >= 1", name="partitions_positive"),
)

participants = Table(
    "participants",
    metadata,
    Column("run", Name, primary_key=True),
    Column("participant_id", Name, primary_key=True),
    Column("kind", String(16), nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("registered_at", Double, nullable=False),
    Column("last_seen_at", Double, nullable=False),
    CheckConstraint("kind IN ('environment', 'policy', 'agent', 'resources')", name="kind_known"),
    ForeignKeyConstraint(["run"], ["runs.run"]),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    Column("run", Name, primary_key=True),
    Column("checkpoint_id", BigInteger, primary_key=True),
    Column("status", String(16), nullable=False),
    Column("trigger", String(64), nullable=False),
    Column("controller_epoch", BigInteger, nullable=False),
    Column("deadline_s", Double, nullable=True),
    Column("requested_at", Double, nullable=False),
    Column("marked_at", Double, nullable=True),
    Column("committed_at", Double, nullable=True),
    # When the checkpoint was aborted or expired.
    Column("ended_at", Double, nullable=True),
    Column("continue_count", Integer, nullable=False, server_default=text("0")),
    Column("restart_count", Integer, nullable=False, server_default=text("0")),
    Column("finished_count", Integer, nullable=False, server_default=text("0")),
    Column("entry_count", Integer, nullable=False, server_default=text("0")),
    Column("size_bytes", BigInteger, nullable=False, server_default=text("0")),
    Column("reason", Text, nullable=True),
    Column("timings_ms", Text, nullable=True),
    CheckConstraint(
        "status IN ('pending', 'committed', 'aborted', 'expired')", name="status_known"
    ),
    ForeignKeyConstraint(["run"], ["runs.run"]),
    # At most one pending checkpoint per run, enforced by the database itself.
    Index(
        "uq_checkpoints_one_pending",
        "run",
        unique=True,
        sqlite_where=text("status = 'pending'"),
        postgresql_where=text("status = 'pending'"),
    ),
)

checkpoint_offsets = Table(
    "checkpoint_offsets",
    metadata,
    Column("run", Name, primary_key=True),
    Column("checkpoint_id", BigInteger, primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("marker_offset", BigInteger, nullable=False),
    Column("replay_from", BigInteger, nullable=True),
    ForeignKeyConstraint(
        ["run", "checkpoint_id"], ["checkpoints.run", "checkpoints.checkpoint_id"]
    ),
)

manifest_entries = Table(
    "manifest_entries",
    metadata,
    Column("run", Name, primary_key=True),
    Column("checkpoint_id", BigInteger, primary_key=True),
    Column("episode", Name, primary_key=True),
    Column("attempt", Integer, nullable=False),
    Column("action", String(16), nullable=False),
    Column("cut_partition", Integer, nullable=False),
    Column("cut_offset", BigInteger, nullable=False),
    Column("last_stage", Text, nullable=True),
    # JSON array of strings, NULL when the episode references no staging keys.
    Column("staging_keys", Text, nullable=True),
    Column("size_bytes", BigInteger, nullable=False),
    # No foreign key to checkpoints and no CHECK on action, on purpose: per-row checks made a
    # 16,000-entry commit 100 ms slower on PostgreSQL (the foreign key) and 50% slower on SQLite
    # (the CHECK). The commit checks every entry's action and locks the checkpoint itself.
    sqlite_with_rowid=False,
)

restores = Table(
    "restores",
    metadata,
    Column("run", Name, primary_key=True),
    Column("restore_id", BigInteger, primary_key=True),
    Column("checkpoint_id", BigInteger, nullable=False),
    Column("controller_epoch", BigInteger, nullable=False),
    Column("committed_at", Double, nullable=False),
    Column("continue_count", Integer, nullable=False),
    Column("restart_count", Integer, nullable=False),
    Column("excluded_count", Integer, nullable=False),
    Column("timings_ms", Text, nullable=True),
    ForeignKeyConstraint(
        ["run", "checkpoint_id"], ["checkpoints.run", "checkpoints.checkpoint_id"]
    ),
)

restore_episodes = Table(
    "restore_episodes",
    metadata,
    Column("run", Name, primary_key=True),
    Column("restore_id", BigInteger, primary_key=True),
    Column("episode", Name, primary_key=True),
    Column("previous_attempt", Integer, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("capture_key", String(NAME_LENGTH + 16), nullable=False),
    Column("action", String(16), nullable=False),
    Column("reason", Text, nullable=True),
    # No foreign key to restores and no CHECK on action, for the same reason as manifest_entries.
    sqlite_with_rowid=False,
)

episodes = Table(
    "episodes",
    metadata,
    Column("run", Name, primary_key=True),
    Column("episode", Name, primary_key=True),
    Column("current_attempt", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("first_partition", Integer, nullable=True),
    Column("first_offset", BigInteger, nullable=True),
    Column("started_at", Double, nullable=True),
    Column("finished_at", Double, nullable=True),
    Column("updated_at", Double, nullable=False),
    CheckConstraint("status IN ('running', 'finished', 'excluded')", name="status_known"),
    ForeignKeyConstraint(["run"], ["runs.run"]),
    Index("ix_episodes_run_status_episode", "run", "status", "episode"),
)
