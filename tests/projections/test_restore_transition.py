"""The restore transition over records (``core._restore``), as the history route reads it: the
boundary a continued attempt resumed from is the last one the transition keeps at its
``attempt.started``, through a chain of continued attempts, and a restore that never committed
changes nothing."""

from __future__ import annotations

from typing import Any

from rolloutlog.core import (
    SERVICE_PARTICIPANT_ID,
    restore_transition,
    resumed_boundary,
    select_records,
)
from tests.factories import envelope, participant

SERVICE = participant("service", SERVICE_PARTICIPANT_ID, 0)


def _boundary(stage: str, attempt: int = 0) -> dict[str, Any]:
    data = {"owner": "environment", "stage": stage, "state": {}}
    return envelope("step.boundary", "e", data, attempt=attempt)


def _attempt_started(restore_id: int, attempt: int, previous: int, cut: int) -> dict[str, Any]:
    data = {"restore_id": restore_id, "checkpoint_id": 1, "previous_attempt": previous, "cut": cut}
    return envelope("attempt.started", "e", data, attempt=attempt, who=SERVICE)


def _history() -> list[tuple[int, dict[str, Any]]]:
    step = {"owner": "environment", "stage": "act"}
    return [
        (0, envelope("episode.started", "e", {"task_digest": "d"})),
        (1, _boundary("seed")),
        (3, _boundary("act")),
        (5, _attempt_started(1, attempt=1, previous=0, cut=3)),
        (6, envelope("step.started", "e", step, attempt=1)),
        (7, _attempt_started(9, attempt=3, previous=1, cut=1)),  # never committed
        (8, _attempt_started(2, attempt=2, previous=1, cut=7)),
    ]


def test_a_continued_attempt_resumes_from_the_last_boundary_below_the_cut() -> None:
    found = resumed_boundary(_history(), 5, {1, 2})
    assert found is not None and (found[0], found[1]["data"]["stage"]) == (1, "seed")


def test_a_continued_continuation_resumes_from_what_its_previous_attempt_continued() -> None:
    # Attempt 1 recorded no boundary before restore 2's cut: attempt 2 resumes from attempt 0's.
    found = resumed_boundary(_history(), 8, {1, 2})
    assert found is not None and found[0] == 1


def test_a_restore_that_never_committed_is_no_transition() -> None:
    records = _history()
    assert restore_transition(records[5][1], {1, 2}) is None
    start = restore_transition(records[6][1], {1, 2})
    assert start is not None and (start.attempt, start.previous_attempt, start.cut) == (2, 1, 7)
    kept, current = select_records(records, 9, {1, 2})
    assert current == 2 and [offset for offset, _ in kept] == [0, 1, 5, 6, 8]
    # Committed, restore 9 would have cut attempt 1 back to below offset 1.
    kept, current = select_records(records, 9, None)
    assert current == 3 and [offset for offset, _ in kept] == [0, 7]
