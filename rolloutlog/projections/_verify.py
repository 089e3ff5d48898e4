"""Restore-time checks of a projection (DESIGN.md §3, §6): lineage, generation cut, task digest,
and the policy-lag rule. Pure functions: each returns why an episode cannot continue, or None."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import orjson

from rolloutlog.projections._fold import ledger_digest, token_count
from rolloutlog.projections._model import EpisodeProjection, LedgerEntry


def canonical_task_digest(task_json: bytes) -> str:
    """sha256 of the task's canonical JSON (sorted keys, no whitespace)."""
    canonical = orjson.dumps(orjson.loads(task_json), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(canonical).hexdigest()


def verify_projection(projection: EpisodeProjection) -> str | None:
    """Why this projection must not be continued (it restarts instead), or None when it can."""
    if projection.task is None or projection.task_digest is None:
        return "no episode.started before the cut"
    if canonical_task_digest(projection.task.raw) != projection.task_digest:
        return "task digest does not match the task"
    rows: dict[str, LedgerEntry] = {}
    for row in projection.ledger:
        problem = _row_problem(row, rows)
        if problem is not None:
            return f"ledger row {row.call_id}: {problem}"
        rows[row.call_id] = row
    cut = projection.generation_cut
    if cut is not None:
        if cut.problem is not None:
            return f"generation cut of call {cut.call_id}: {cut.problem}"
        if cut.parent_call_id is not None and cut.parent_call_id not in rows:
            return f"generation cut of call {cut.call_id}: its parent {cut.parent_call_id} is not in the ledger"
    return None


def _row_problem(row: LedgerEntry, rows: dict[str, LedgerEntry]) -> str | None:
    if row.parent_call_id is None:
        parent_digest, parent_len = "", 0
    else:
        parent = rows.get(row.parent_call_id)
        if parent is None:
            return f"parent {row.parent_call_id} is not in the ledger"
        parent_digest, parent_len = parent.digest, parent.cum_len
    if row.prev_len != parent_len:
        return f"prev_len {row.prev_len} does not chain to the parent's cum_len {parent_len}"
    if row.cum_len != row.prev_len + token_count(row.token_ids_json):
        return "cum_len does not equal prev_len plus its token count"
    if ledger_digest(parent_digest, row.token_ids_json) != row.digest:
        return "digest does not recompute"
    return None


def apply_policy(
    projection: EpisodeProjection, policy_version: int | None, max_policy_lag: int | None
) -> tuple[EpisodeProjection, str | None]:
    """The restore policy: a generation cut older than ``policy_version - max_policy_lag`` (or
    newer than ``policy_version``) is dropped, and an episode whose committed ledger is older than
    that restarts. Returns the (possibly changed) projection and a restart reason or None."""
    if policy_version is None:
        return projection, None
    oldest = policy_version - max_policy_lag if max_policy_lag is not None else None
    if projection.ledger and oldest is not None:
        newest_row = max(row.policy_version for row in projection.ledger)
        if newest_row < oldest:
            return projection, (
                f"ledger policy version {newest_row} is older than {policy_version} - "
                f"max_policy_lag {max_policy_lag}"
            )
    cut = projection.generation_cut
    if cut is not None and (
        cut.policy_version > policy_version or (oldest is not None and cut.policy_version < oldest)
    ):
        projection = replace(projection, generation_cut=None)
    return projection, None
