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
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    or_,
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
    # A fork (migration 0012): the run and committed checkpoint it branched from, its request
    # (JSON), and when it was created whole. While ``forked_at`` is NULL the fork is being
    # created: the row only claims the name, and every read but the fork's own skips it.
    Column("forked_from_run", Name, nullable=True),
    Column("forked_from_checkpoint", BigInteger, nullable=True),
    Column("forked_at", Double, nullable=True),
    Column("fork_request", Text, nullable=True),
    # Who creates it (migration 0012): the replica holding the claim and its ``started_at``
    # then (``catalog/_forks.py``); NULL once the fork is created whole.
    Column("fork_claimed_by", Name, nullable=True),
    Column("fork_claimer_started_at", Double, nullable=True),
    CheckConstraint("partitions >= 1", name="partitions_positive"),
    Index("ix_runs_forked_from_run", "forked_from_run"),
)

RUN_VISIBLE = or_(runs.c.forked_from_run.is_(None), runs.c.forked_at.is_not(None))
"""The runs every read sees: all but forks still being created (``catalog/_forks.py``)."""

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
    # The replica that took the request, and its ``replicas.started_at`` then (migration 0010):
    # a pending checkpoint whose requester is gone is superseded by the next request.
    Column("requested_by", Name, nullable=True),
    Column("requester_started_at", Double, nullable=True),
    # The client's id of the request it answers (migration 0010): a request sent again after it
    # went unanswered finds its own checkpoint (``ix_checkpoints_request``).
    Column("request_id", String(64), nullable=True),
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
    Index("ix_checkpoints_request", "run", "request_id"),
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

manifest_parts = Table(
    "manifest_parts",
    metadata,
    Column("run", Name, primary_key=True),
    Column("checkpoint_id", BigInteger, primary_key=True),
    Column("cut_partition", Integer, primary_key=True),
    # JSON array of the partition's entries in episode order, each [episode, attempt, action,
    # cut_partition, cut_offset, last_stage, [staging keys], size_bytes, reason] (``ManifestEntry``'s
    # fields): one row per partition instead of one per episode (a 16,000-episode commit inserts
    # 16 rows).
    Column("entries", Text, nullable=False),
    Column("entry_count", Integer, nullable=False),
    sqlite_with_rowid=False,
)

manifest_chain = Table(
    "manifest_chain",
    metadata,
    Column("run", Name, primary_key=True),
    Column("checkpoint_id", BigInteger, primary_key=True),
    # A chain per partition (migration 0009): each partition's part is whole or a delta of its
    # own base, so partitions written by different replicas may have chains of their own.
    Column("partition", Integer, primary_key=True),
    # 0: the checkpoint's own part; 1: the part of the checkpoint it amends; and so on to a
    # checkpoint whose part is whole. A delta part holds only the entries that changed since its
    # base, and ``removed`` tombstones for episodes it no longer names: the manifest is, per
    # episode, the entry of the smallest depth, unless that is a tombstone.
    Column("depth", Integer, primary_key=True),
    Column("ancestor_id", BigInteger, nullable=False),
    sqlite_with_rowid=False,
)
"""Which checkpoints' parts make up each partition of each retained committed checkpoint's
manifest (migrations 0007, 0009): written when the checkpoint commits; rows of an expired
checkpoint go with its expiry; parts stay while a chain names them."""

views = MetaData()
"""Views over the tables; not tables. The migrations create them (their SQL, one per database,
is the migration's that last changed the view: ``manifest_entries``, 0009)."""

manifest_entries = Table(
    "manifest_entries",
    views,
    Column("run", Name),
    Column("checkpoint_id", BigInteger),
    Column("episode", Name),
    Column("attempt", Integer),
    Column("action", String(16)),
    Column("cut_partition", Integer),
    Column("cut_offset", BigInteger),
    Column("last_stage", Text),
    # JSON array of strings, NULL when the episode references no staging keys.
    Column("staging_keys", Text),
    Column("size_bytes", BigInteger),
    # Why a ``restart`` entry restarts (NULL otherwise, and in entries written before 0006).
    Column("reason", Text),
)
"""One row per manifest entry, for analysts' SQL and set-based queries: a view over
``manifest_parts`` along each checkpoint's chains (migration 0009)."""

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
    # No foreign key to restores and no CHECK on action: per-row checks made a 16,000-entry
    # commit 100 ms slower on PostgreSQL (the foreign key) and 50% slower on SQLite (the CHECK).
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
    # In a fork (migration 0012): the attempt the episode had in the source at the fork (its
    # attempts up to this one are the source's, copied); NULL otherwise.
    Column("forked_attempt", Integer, nullable=True),
    CheckConstraint("status IN ('running', 'finished', 'excluded')", name="status_known"),
    ForeignKeyConstraint(["run"], ["runs.run"]),
    Index("ix_episodes_run_status_episode", "run", "status", "episode"),
)
# (On PostgreSQL its pages keep room for a restore's updates: ``fillfactor = 70``, migration 0013.)

quarantined_records = Table(
    "quarantined_records",
    metadata,
    Column("run", Name, primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("offset", BigInteger, primary_key=True),
    Column("reason", Text, nullable=False),
    # The record's whole size, and its first bytes (at most 256) as logged.
    Column("size", BigInteger, nullable=False),
    Column("first_bytes", LargeBinary, nullable=False),
    Column("recorded_at", Double, nullable=False),
    # No foreign key to runs: a record is quarantined while the run's rows are written elsewhere,
    # and the projector's batch must never fail on an ordering between the two.
)

results = Table(
    "results",
    metadata,
    Column("run", Name, primary_key=True),
    Column("episode", Name, primary_key=True),
    # The finished attempt (a finish of a newer attempt replaces an abandoned one's).
    Column("attempt", Integer, nullable=False),
    Column("partition", Integer, nullable=False),
    Column("finished_offset", BigInteger, nullable=False),
    # The ``episode.finished`` event's ``ts``.
    Column("ts", Double, nullable=False),
    Column("reward", Double, nullable=True),
    # The opaque ``result`` payload's raw JSON, NULL when the event had none.
    Column("result", Text, nullable=True),
    Column("recorded_at", Double, nullable=False),
    # NULL until the trainer acknowledges the result (``POST …/results/ack``).
    Column("acknowledged_at", Double, nullable=True),
    ForeignKeyConstraint(["run"], ["runs.run"]),
    # What a restore counts and a resuming trainer reads: the results not acknowledged yet.
    Index(
        "ix_results_unacknowledged",
        "run",
        "episode",
        sqlite_where=text("acknowledged_at IS NULL"),
        postgresql_where=text("acknowledged_at IS NULL"),
    ),
)
"""Finished episodes' results, copied from their ``episode.finished`` records by the projector's
episode feeder: they outlive the log's retention (trimmed below the retained checkpoints) and
the manifests' (only the newest N are kept), and carry the trainer's acknowledgement."""


replicas = Table(
    "replicas",
    metadata,
    Column("replica_id", Name, primary_key=True),
    # Where the replica serves (``host:port``), for operators; NULL when it did not say.
    Column("address", Text, nullable=True),
    Column("started_at", Double, nullable=False),
    Column("heartbeat_at", Double, nullable=False),
    # The replica counts as live until this time (the catalog's clock); its leases lapse then.
    Column("expires_at", Double, nullable=False),
    # The replica's report of its projectors (JSON, migration 0011): per run, its health and per
    # owned partition the lease generation and lag; written by every heartbeat.
    Column("health", Text, nullable=True),
)
"""The service replicas sharing this catalog (migration 0008): one row per replica, renewed by
its heartbeat."""

partition_leases = Table(
    "partition_leases",
    metadata,
    Column("run", Name, primary_key=True),
    Column("partition", Integer, primary_key=True),
    # The owner; NULL while released (a new owner takes it at the next generation).
    Column("replica_id", Name, nullable=True),
    # Bumped at every change of owner: a part written under an older one is refused (fencing).
    Column("generation", BigInteger, nullable=False),
    Column("acquired_at", Double, nullable=False),
    ForeignKeyConstraint(["run"], ["runs.run"]),
)
"""Which replica folds each partition of each run (migration 0008)."""

checkpoint_parts = Table(
    "checkpoint_parts",
    metadata,
    Column("run", Name, primary_key=True),
    Column("checkpoint_id", BigInteger, primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("replica_id", Name, nullable=False),
    # The lease generation the part was written under.
    Column("generation", BigInteger, nullable=False),
    Column("written_at", Double, nullable=False),
    # The writer's counts (JSON) over every partition it wrote in one transaction, on the row of
    # its lowest partition (NULL on the others): summed into the checkpoint's when it commits.
    Column("totals", Text, nullable=True),
    # The checkpoint this partition's part is a delta of (NULL: the part is whole; migration
    # 0009): its chain in ``manifest_chain`` is written from this when the checkpoint commits.
    Column("base_checkpoint_id", BigInteger, nullable=True),
)
"""Who wrote each partition's part of a checkpoint's manifest (migration 0008): a checkpoint
commits when every partition has one."""

restore_requests = Table(
    "restore_requests",
    metadata,
    Column("run", Name, primary_key=True),
    Column("restore_id", BigInteger, primary_key=True),
    Column("checkpoint_id", BigInteger, nullable=False),
    Column("controller_epoch", BigInteger, nullable=False),
    # The replica that took the trainer's request and commits (or aborts) it.
    Column("requested_by", Name, nullable=False),
    Column("status", String(16), nullable=False),
    # The request as the owners plan it (JSON: exclusions, policy).
    Column("request", Text, nullable=False),
    Column("requested_at", Double, nullable=False),
    # Past this time any replica may abort a request still ``planning``.
    Column("deadline_at", Double, nullable=False),
    Column("ended_at", Double, nullable=True),
    Column("reason", Text, nullable=True),
    CheckConstraint("status IN ('planning', 'committed', 'aborted')", name="status_known"),
    ForeignKeyConstraint(["run"], ["runs.run"]),
)
"""Restores being planned by the partitions' owners, and how each ended (migration 0008)."""

restore_parts = Table(
    "restore_parts",
    metadata,
    Column("run", Name, primary_key=True),
    Column("restore_id", BigInteger, primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("replica_id", Name, nullable=False),
    Column("generation", BigInteger, nullable=False),
    Column("written_at", Double, nullable=False),
    # The partition's plan entries (JSON).
    Column("entries", Text, nullable=False),
)
"""Each partition owner's part of a restore plan (migration 0008)."""
