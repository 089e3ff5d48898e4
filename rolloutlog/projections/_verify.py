"""Restore-time checks of a projection (docs/design.md §3, §6): lineage, generation cut, task digest,
and the policy-lag rule. Pure functions: each returns why an episode cannot continue, or None."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from rolloutlog.log import ledger_digest, task_digest, token_count
from rolloutlog.projections._model import EpisodeProjection


def verify_projection(projection: EpisodeProjection) -> str | None:
    """Why this projection must not be continued (it restarts instead), or None when it can."""
    if projection.task is None or projection.task_digest is None:
        return "no episode.started before the cut"
    if task_digest(projection.task.raw) != projection.task_digest:
        return "task digest does not match the task"
    rows: dict[str, tuple[str, int]] = {}
    for row in projection.ledger:
        problem = ledger_row_problem(
            row.parent_call_id, row.prev_len, row.cum_len, row.digest, row.token_ids_json, rows
        )
        if problem is not None:
            return f"ledger row {row.call_id}: {problem}"
        rows[row.call_id] = (row.digest, row.cum_len)
    cut = projection.generation_cut
    if cut is not None:
        return generation_cut_problem(cut.call_id, cut.problem, cut.parent_call_id, rows)
    return None


def ledger_row_problem(
    parent_call_id: str | None,
    prev_len: int,
    cum_len: int,
    digest: str,
    token_ids_json: bytes,
    rows: Mapping[str, tuple[str, int]],
) -> str | None:
    """Why one ledger row does not chain to the rows before it (``rows``: call id → (digest,
    cum_len) of the earlier rows), or None. The projector asks this of each row as it arrives."""
    if parent_call_id is None:
        parent_digest, parent_len = "", 0
    else:
        parent = rows.get(parent_call_id)
        if parent is None:
            return f"parent {parent_call_id} is not in the ledger"
        parent_digest, parent_len = parent
    if prev_len != parent_len:
        return f"prev_len {prev_len} does not chain to the parent's cum_len {parent_len}"
    if cum_len != prev_len + token_count(token_ids_json):
        return "cum_len does not equal prev_len plus its token count"
    if ledger_digest(parent_digest, token_ids_json) != digest:
        return "digest does not recompute"
    return None


def generation_cut_problem(
    call_id: str,
    problem: str | None,
    parent_call_id: str | None,
    rows: Mapping[str, tuple[str, int]],
) -> str | None:
    if problem is not None:
        return f"generation cut of call {call_id}: {problem}"
    if parent_call_id is not None and parent_call_id not in rows:
        return f"generation cut of call {call_id}: its parent {parent_call_id} is not in the ledger"
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
