"""What the projector keeps per live episode (its tracker) stays small: 16,000 live S1 episodes'
trackers are most of what the service holds between checkpoints."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

from rolloutlog.core._episode import EventFilters
from rolloutlog.log import encode_record, peek_record
from rolloutlog.projections._tracker import EpisodeTracker
from tests import factories as f

#: Bytes one S1-shaped live episode's tracker may hold (3,773 measured by this test since it keeps
#: the positions of its projection's payloads, which a restore composes from: 3,373 before; 5,120
#: before its names were interned, its filters kept one entry per participant and its unused
#: containers went: docs/design.md, "What a live episode costs the projector").
TRACKER_BYTES = 4_000


def _s1_records(episode: str) -> list[bytes]:
    """S1's shape (``benchmarks/workloads.s1_episode``): start, a session, two turns (ledger row,
    session state, boundary), then a step in flight with a generation chunk."""
    policy = f.participant("policy", "policy-0")
    resources = f.participant("resources", "res-0")
    events = [
        f.started(episode),
        f.session_started(episode, mode="exported", verify="replay", who=resources),
    ]
    parent: dict[str, Any] | None = None
    for turn in range(2):
        row = f.ledger_row(episode, f"c{turn}", parent=parent, who=policy)
        parent = {"call_id": f"c{turn}", "cum_len": 512 * (turn + 1), "digest": row.data.digest}
        events += [
            row,
            f.session_state(episode, state={"turn": turn}, who=resources),
            f.boundary(episode, "invoke_agent", {"turn": turn}, nxt="invoke_agent"),
        ]
    events += [f.step_started(episode, "invoke_agent"), f.chunk(episode, "c2", n=64, who=policy)]
    return [encode_record(event) for event in events]


def _follow(episodes: list[list[bytes]]) -> list[EpisodeTracker]:
    """Each episode's records decoded and observed as the projector does (``Projector._take``)."""
    trackers = []
    for records in episodes:
        tracker = None
        for offset, record in enumerate(records):
            meta, start = peek_record(record)
            if tracker is None:
                tracker = EpisodeTracker(meta["episode"], 0)
            assert tracker.observe(offset, meta, record, start)
        assert tracker is not None and tracker.verdict() is None and not tracker.finished
        trackers.append(tracker)
    return trackers


def test_a_live_s1_episodes_tracker_holds_under_its_bound() -> None:
    episodes = [_s1_records(f"ep-{index}") for index in range(400)]
    _follow(episodes[:10])  # the interned names and the code's caches exist before counting
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        trackers = _follow(episodes)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(trackers) == 400
    assert held / 400 < TRACKER_BYTES, held / 400


def test_trackers_share_the_names_every_episode_repeats() -> None:
    first, second = _follow([_s1_records("a"), _s1_records("b")])
    assert [id(pid) for pid in first.filters.seen] == [id(pid) for pid in second.filters.seen]
    assert first.boundaries["environment"].stage is second.boundaries["environment"].stage
    assert first.last_stage is first.boundaries["environment"].stage
    one, other = first.sessions["s1"], second.sessions["s1"]
    assert all(a is b for a, b in zip(one[:5], other[:5], strict=True))
    assert next(iter(first.lineage.rows)) is next(iter(second.lineage.rows))  # type: ignore[union-attr]


def _admits(filters: EventFilters, pid: str, epoch: int, seq: int, attempt: int = 0) -> bool:
    meta = {"participant": {"id": pid, "epoch": epoch}, "seq": seq, "attempt": attempt}
    return filters.admits(meta)


def test_one_filter_entry_per_participant_keeps_the_zombie_and_duplicate_rules() -> None:
    filters = EventFilters()
    assert _admits(filters, "env", 1, 5)
    assert not _admits(filters, "env", 1, 5)  # a duplicate
    assert not _admits(filters, "env", 1, 3)  # an older seq of the same epoch
    assert _admits(filters, "policy", 1, 1)  # another participant counts on its own
    assert _admits(filters, "env", 2, 1)  # a new epoch starts its seqs over
    assert not _admits(filters, "env", 1, 9)  # the old epoch is a zombie now
    assert not _admits(filters, "env", 2, 1)
    assert _admits(filters, "env", 2, 2)
    assert not _admits(filters, "env", 2, 3, attempt=1)  # fenced attempt, yet seen
    assert not _admits(filters, "env", 2, 3)
    assert filters.last_seq(("env", 2)) == 3
    assert filters.last_seq(("env", 1)) is None
    assert filters.last_seq(("policy", 1)) == 1
    assert filters.last_seq(("nobody", 1)) is None
