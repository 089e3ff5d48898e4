"""Restore-time checks of an episode (docs/design.md §3, §6): lineage, generation cut, task digest
(``Lineage``, used by the fold as records arrive and by ``verify_projection``), and the policy-lag
rule. Each check returns why an episode cannot continue, or None."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from rolloutlog.core._digests import ledger_digest, task_digest, token_count
from rolloutlog.core._model import EpisodeProjection


class Lineage:
    """The restore's checks of one episode (§3, §6), written once: the task matches its digest,
    each ledger row chains to the rows before it, the generation cut's parent is in the ledger.

    The rows come in ledger order; a row waits (pending) until the boundary that commits it, and
    is checked against the committed rows and the pending rows before it — the rows that come
    before it in the ledger if the boundary commits. A state that drops payloads (the projector's)
    checks each row as it arrives, then forgets its token ids; ``verify_projection`` runs the same
    checks over a projection's committed ledger.
    """

    __slots__ = ("ledger_problem", "pending", "rows", "task_problem", "task_seen")

    def __init__(self) -> None:
        self.task_seen = False
        self.task_problem: str | None = None
        #: Committed rows: call id → (digest, cum_len).
        self.rows: dict[str, tuple[str, int]] = {}
        #: The first committed row that does not chain, as a restart reason.
        self.ledger_problem: str | None = None
        #: Rows waiting for the next boundary: (call id, digest, cum_len, problem or None).
        self.pending: list[tuple[str, str, int, str | None]] = []

    def task(self, task_json: bytes | memoryview | None, digest: str | None) -> None:
        """An ``episode.started`` (its task's raw JSON and the digest it claims)."""
        self.task_seen = task_json is not None and digest is not None
        self.task_problem = None
        if task_json is not None and digest is not None and task_digest(task_json) != digest:
            self.task_problem = "task digest does not match the task"

    def row(
        self,
        call_id: str,
        parent_call_id: str | None,
        prev_len: int,
        cum_len: int,
        digest: str,
        token_ids_json: bytes,
    ) -> None:
        """A ledger row, pending until ``commit``."""
        earlier = self.rows
        if self.pending:
            earlier = {**earlier, **{row[0]: (row[1], row[2]) for row in self.pending}}
        problem = ledger_row_problem(
            parent_call_id, prev_len, cum_len, digest, token_ids_json, earlier
        )
        self.pending.append((call_id, digest, cum_len, problem))

    def commit(self) -> None:
        """A boundary: the pending rows join the ledger."""
        for call_id, digest, cum_len, problem in self.pending:
            if problem is not None and self.ledger_problem is None:
                self.ledger_problem = f"ledger row {call_id}: {problem}"
            self.rows[call_id] = (digest, cum_len)
        self.pending.clear()

    def drop_tail(self) -> None:
        """A restore dropped the uncommitted rows."""
        self.pending.clear()

    def copy(self) -> Lineage:
        other = Lineage()
        other.task_seen = self.task_seen
        other.task_problem = self.task_problem
        other.rows = dict(self.rows)
        other.ledger_problem = self.ledger_problem
        other.pending = list(self.pending)
        return other

    def verdict(
        self, cut_call_id: str | None, cut_problem: str | None, cut_parent: str | None
    ) -> str | None:
        """Why the episode cannot continue (it restarts), or None; ``cut_*`` describe its
        generation cut (``cut_call_id`` None: it has none)."""
        if not self.task_seen:
            return "no episode.started before the cut"
        if self.task_problem is not None:
            return self.task_problem
        if self.ledger_problem is not None:
            return self.ledger_problem
        if cut_call_id is not None:
            return generation_cut_problem(cut_call_id, cut_problem, cut_parent, self.rows)
        return None


def verify_projection(projection: EpisodeProjection) -> str | None:
    """Why this projection must not be continued (it restarts instead), or None when it can."""
    lineage = Lineage()
    task = projection.task
    lineage.task(task.raw if task is not None else None, projection.task_digest)
    if lineage.task_seen and lineage.task_problem is None:
        for row in projection.ledger:
            lineage.row(
                row.call_id,
                row.parent_call_id,
                row.prev_len,
                row.cum_len,
                row.digest,
                row.token_ids_json,
            )
            lineage.commit()
            if lineage.ledger_problem is not None:
                break  # the first row that does not chain is the reason
    cut = projection.generation_cut
    if cut is None:
        return lineage.verdict(None, None, None)
    return lineage.verdict(cut.call_id, cut.problem, cut.parent_call_id)


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
