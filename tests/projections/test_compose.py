"""A projection composed from the records its tracker's positions name (``core._compose``) is the
fold's projection, line for line, and a restore serves composed lines without folding again.

- random episodes (ledger rows right and wrong, generation chunks with gaps, sessions opened,
  changed and ended, boundaries of two owners, tasks, restores committed or not), composed at
  every cut from the projector's tracker and folded in full: the same NDJSON line;
- a service's restore whose plan pinned the trackers composes every continued projection (no
  replay runs) and serves the lines a replay of the log gives.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutlog.core import (
    SPLICE_BYTES,
    EpisodeFold,
    ProjectionLine,
    composable,
    compose_projection,
    mapped,
    projection_positions,
)
from rolloutlog.log import (
    Event,
    encode_record,
    peek_record,
    record_payload_start,
    validate_event,
)
from rolloutlog.projections import CheckpointResult, _prepared, _replay, project_events
from rolloutlog.projections import _projection_server as projection_server
from tests import factories as f
from tests.projections.both_modes import follow
from tests.projections.conftest import open_service
from tests.projections.test_fast_paths import _scenario, lineage_stream

RES = f.participant("resources", "res-0", 1)
AGENT = f.participant("agent", "agent-0", 1)


def _ended(episode: str, session_id: str, **kw: Any) -> Event:
    return validate_event(f.envelope("session.ended", episode, {"session_id": session_id}, **kw))


def _agent_boundary(episode: str, stage: str, **kw: Any) -> Event:
    data = {"owner": "agent-1", "stage": stage, "next": None, "state": None}
    return validate_event(f.envelope("step.boundary", episode, data, who=AGENT, **kw))


def _composed(state: EpisodeFold, events: list[Event], cut: int) -> ProjectionLine:
    records = {offset: encode_record(event) for offset, event in enumerate(events)}
    wanted = {offset: records[offset] for offset in projection_positions(state)}
    projection = compose_projection(state, wanted, cut, record_payload_start, peek_record)
    return ProjectionLine.of(projection)


def _composed_line(state: EpisodeFold, events: list[Event], cut: int) -> bytes:
    return _composed(state, events, cut).line


@settings(max_examples=400, deadline=None)
@given(lineage_stream(), st.integers(0, 24))
def test_a_composed_projection_is_the_folds_line_for_line(
    stream: tuple[list[Event], set[int]], cut: int
) -> None:
    events, committed = stream
    offsets = list(enumerate(events))
    tracker = follow("e", offsets, cut, committed, keep_payloads=False)
    if not composable(tracker):
        # Only what a tracker cannot compose: not exactly the fold's state, finished, or
        # nothing recorded yet.
        assert not tracker.exact or tracker.finished or tracker.first_offset is None
        return
    assert all(offset < cut for offset in projection_positions(tracker))
    folded = project_events("e", offsets, cut, committed)
    prepared = _composed(tracker, events, cut)
    assert prepared.line == ProjectionLine.of(folded).line
    # A line prepared at the cut, given a restore's attempt (``ProjectionLine.as_attempt``), is
    # the one composed from the state that restore continues (``continue_at_cut``).
    attempt = tracker.attempt
    tracker.pin()
    tracker.continue_at_cut(attempt + 2)
    assert composable(tracker)
    assert prepared.as_attempt(attempt + 2, was=attempt) == _composed(tracker, events, cut)
    with pytest.raises(ValueError):
        prepared.as_attempt(attempt + 2, was=attempt + 1)  # not that attempt's line


def test_sessions_and_boundaries_come_from_their_latest_records() -> None:
    """A session's state from its latest committed state (not the tail's), one ended and one
    opened again without a state, two owners' boundaries, a step in flight."""
    events = [
        f.started("e", seq=1),
        f.session_started("e", "s1", "exported", who=RES, seq=1),
        f.session_state("e", "s1", {"n": 1}, who=RES, seq=2),
        f.boundary("e", "seed", {"turn": 1}, seq=2),
        f.session_state("e", "s1", {"n": 2}, who=RES, seq=3),
        f.session_started("e", "s2", "exported", who=RES, seq=4),
        f.session_state("e", "s2", {"m": 1}, who=RES, seq=5),
        f.boundary("e", "invoke_agent", {"turn": 2}, seq=3),
        _ended("e", "s2", who=RES, seq=6),
        f.session_started("e", "s2", "exported", who=RES, seq=7),
        _agent_boundary("e", "invoke_agent", seq=1),
        f.session_state("e", "s1", {"n": 3}, who=RES, seq=8),  # the tail: dropped
        f.chunk("e", "c1", 0, 3),
    ]
    offsets = list(enumerate(events))
    for cut in range(1, len(events) + 1):
        tracker = follow("e", offsets, cut, None, keep_payloads=False)
        assert composable(tracker)
        folded = project_events("e", offsets, cut)
        assert _composed_line(tracker, events, cut) == ProjectionLine.of(folded).line
    sessions = folded.to_json()["sessions"]
    assert sessions["s1"]["state"].raw == b'{"n":2}'
    assert sessions["s2"]["state"] is None


def test_large_states_go_into_the_line_as_views_of_their_records() -> None:
    """A state of ``SPLICE_BYTES`` or more is a piece of the composed line that is a view of
    its record, not a copy; the joined line is the fold's, and a smaller state is copied (it
    keeps no record alive)."""
    big = {"blob": "b" * SPLICE_BYTES}
    events = [
        f.started("e", seq=1),
        f.session_started("e", "s1", "exported", who=RES, seq=1),
        f.session_state("e", "s1", {"blob": "s" * SPLICE_BYTES}, who=RES, seq=2),
        f.session_started("e", "s2", "exported", who=RES, seq=3),
        f.session_state("e", "s2", {"small": 1}, who=RES, seq=4),
        f.boundary("e", "seed", big, seq=2),
    ]
    offsets = list(enumerate(events))
    cut = len(events)
    tracker = follow("e", offsets, cut, None, keep_payloads=False)
    records = {offset: encode_record(event) for offset, event in enumerate(events)}
    wanted = {offset: records[offset] for offset in projection_positions(tracker)}
    line = ProjectionLine.of(
        compose_projection(tracker, wanted, cut, record_payload_start, peek_record)
    )
    assert line.line == ProjectionLine.of(project_events("e", offsets, cut)).line
    views = [piece for piece in line.pieces if isinstance(piece, memoryview)]
    assert sorted(id(view.obj) for view in views) == sorted(id(records[o]) for o in (2, 5))
    assert line.size == len(line.line)
    assert isinstance(line.pieces[0], bytes)
    again = line.as_attempt(tracker.attempt + 1, was=tracker.attempt)
    assert [id(p) for p in again.pieces[1:]] == [id(p) for p in line.pieces[1:]]  # not copied


def test_what_cannot_be_composed_is_left_to_a_replay() -> None:
    """Delta boundaries compose onto their base in a replay; a state continued from a
    projection has no positions."""
    events = [
        f.started("e", seq=1),
        f.boundary("e", "seed", {"turn": 1}, seq=2),
        f.boundary("e", "invoke_agent", {"$delta": {"set": {"turn": 2}}}, seq=3),
    ]
    tracker = follow("e", list(enumerate(events)), len(events), None, keep_payloads=False)
    assert tracker.boundary_deltas
    assert not composable(tracker)
    projection = project_events("e", list(enumerate(events[:2])), 2)
    tracker.continue_from(projection, 1)
    assert not composable(tracker)


async def _restored_and_served(
    service: Any, *, prepared: bool = False
) -> tuple[Any, dict[str, bytes]]:
    """A checkpoint and a restore of it, with the lines the restore serves by episode: once the
    checkpoint's lines are prepared (``prepared``), or with its prepare cancelled before it
    ran (the restore composes them)."""
    checkpoint = await service.checkpoint()
    assert isinstance(checkpoint, CheckpointResult)
    preparer = service.coordinator.preparer
    if prepared:
        assert (await _prepare_ended(service)).state == "ready"
    else:
        preparer.forget(service.run)
    restored = await service.restore()
    restore_id = restored.restore.restore_id
    lines = await service.coordinator.restore_projection_lines(service.run, restore_id)
    return restored, {episode: line.line for episode, line in (await lines.complete()).items()}


async def _prepare_ended(service: Any) -> Any:
    """The run's newest prepare, once it has ended."""
    prepared = service.coordinator.preparer.status()[service.run]
    assert prepared.task is not None
    await prepared.task
    return prepared


async def _replayed_lines(service: Any, restore_id: int) -> dict[str, bytes]:
    """The restore's lines rebuilt by a replay of the log (its cache dropped first)."""
    service.coordinator._restore_cache.forget_run(service.run)
    again = await service.coordinator.restore_projections(service.run, restore_id)
    return {episode: ProjectionLine.of(p).line for episode, p in again.items()}


@pytest.mark.parametrize("prepared", [False, True], ids=["composed", "prepared"])
async def test_a_pinned_restore_serves_composed_lines_that_a_replay_gives(
    tmp_path: Path, monkeypatch: Any, prepared: bool
) -> None:
    """A restore of a checkpoint this service captured serves its continued projections
    composed from their records (no fold): the lines prepared when the checkpoint committed,
    given the restore's attempts, or composed after its commit; either way a replay's lines."""
    ahead: list[int] = []
    composed: list[int] = []
    replayed: list[int] = []
    real_compose, real_replay = projection_server.compose_stream, projection_server.replay_stream

    def count_ahead(*args: Any, **kw: Any) -> Any:
        ahead.append(len(args[2]))
        return real_compose(*args, **kw)

    def count_compose(*args: Any, **kw: Any) -> Any:
        composed.append(len(args[2]))
        return real_compose(*args, **kw)

    monkeypatch.setattr(_prepared, "compose_stream", count_ahead)

    def count_replay(*args: Any, **kw: Any) -> Any:
        replayed.append(len(args[2]))
        return real_replay(*args, **kw)

    monkeypatch.setattr(projection_server, "compose_stream", count_compose)
    monkeypatch.setattr(projection_server, "replay_stream", count_replay)
    service = await open_service(tmp_path)
    try:
        for events in _scenario():
            await service.append(*events)
        await service.append(
            f.started("g", seq=1),
            f.session_started("g", "s1", "exported", who=RES, seq=1),
            f.session_state("g", "s1", {"n": 1}, who=RES, seq=2),
            f.boundary("g", "seed", {"turn": 1}, seq=2),
            f.ledger_row("g", "c1", [1, 2, 3]),
            f.boundary("g", "invoke_agent", {"turn": 2}, seq=3),
            f.chunk("g", "c2", 0, 4),
        )
        restored, served = await _restored_and_served(service, prepared=prepared)
        restore_id = restored.restore.restore_id
        continued = {e.episode for e in restored.entries if e.action == "continue"}
        assert set(served) == continued == {"a", "e", "g"}
        # Every continued projection composed: ahead, when the checkpoint committed (each
        # entry the manifest continues: the restore's verdicts restart two of them), or by the
        # restore; none replayed.
        assert (ahead, composed) == (([5], [0]) if prepared else ([], [3]))
        assert replayed == []
        again = await _replayed_lines(service, restore_id)
        assert replayed == [3]
        assert served == again  # byte for byte, the restore's attempts and capture keys too
        assert all(line.startswith(b'{"episode":') for line in served.values())
        assert {orjson.loads(line)["attempt"] for line in served.values()} == {1}
    finally:
        await service.close()


async def test_an_episode_that_cannot_be_composed_at_its_turn_is_replayed(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Records that are not what a tracker says (made to happen here: the second composition
    fails; a tracker that moved on before its records were read takes the same way out): that
    episode is replayed, and every line is still the replay's."""
    real = _replay.compose_projection
    calls: list[str] = []

    def fail_once(state: Any, *args: Any) -> Any:
        calls.append(state.episode)
        if len(calls) == 2:
            raise KeyError("a record that is not what the tracker saw")
        return real(state, *args)

    monkeypatch.setattr(_replay, "compose_projection", fail_once)
    service = await open_service(tmp_path)
    try:
        for events in _scenario():
            await service.append(*events)
        restored, served = await _restored_and_served(service)
        restore_id = restored.restore.restore_id
        assert len(calls) == 2 and set(served) == {"a", "e"}
        again = await _replayed_lines(service, restore_id)
        assert served == again
    finally:
        await service.close()


async def test_a_prepare_that_fails_midway_leaves_the_rest_to_its_restore(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The prepare's read fails after its first line (made to happen here; a log that goes
    away does the same): what it prepared is served, the restore composes the rest, and every
    line is still the replay's."""
    real = _prepared.compose_stream

    async def fail_after_one(*args: Any, **kw: Any) -> Any:
        async for projection in real(*args, **kw):
            yield projection
            raise OSError("the log went away")

    monkeypatch.setattr(_prepared, "compose_stream", fail_after_one)
    monkeypatch.setattr(_prepared, "DELAY_S", 0.0)
    service = await open_service(tmp_path)
    try:
        for events in _scenario():
            await service.append(*events)
        checkpoint = await service.checkpoint()
        preparer = service.coordinator.preparer
        ended = await _prepare_ended(service)
        assert ended.state == "failed"
        assert len(ended.lines) == 1
        restored = await service.restore()
        restore_id = restored.restore.restore_id
        lines = await service.coordinator.restore_projection_lines(service.run, restore_id)
        served = {e: line.line for e, line in (await lines.complete()).items()}
        assert set(served) == {"a", "e"}
        assert served == await _replayed_lines(service, restore_id)
        assert checkpoint.checkpoint.checkpoint_id not in {
            p.checkpoint_id for p in preparer.status().values()
        }  # taken by the restore
    finally:
        await service.close()


async def test_a_checkpoint_that_begins_cancels_the_previous_ones_prepare(
    tmp_path: Path,
) -> None:
    """Checkpoints back to back: the first one's prepare (due 1 s after its commit) never runs,
    the newest one's is the run's."""
    service = await open_service(tmp_path)
    try:
        for events in _scenario():
            await service.append(*events)
        first = await service.checkpoint()
        preparer = service.coordinator.preparer
        task = preparer.status()[service.run].task
        second = await service.checkpoint()
        assert task is not None and task.cancelled()
        prepared = preparer.status()[service.run]
        assert prepared.checkpoint_id == second.checkpoint.checkpoint_id
        assert prepared.checkpoint_id != first.checkpoint.checkpoint_id
        assert prepared.state == "preparing" and not prepared.lines
    finally:
        await service.close()


async def test_a_prepare_keeps_the_lines_of_the_episodes_unchanged_since_the_previous_one(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Two checkpoints with one new episode between them: the second prepare composes only
    that one and carries the others' lines over; its restore serves a replay's lines."""
    ahead: list[int] = []
    real = _prepared.compose_stream

    def count_ahead(*args: Any, **kw: Any) -> Any:
        ahead.append(len(args[2]))
        return real(*args, **kw)

    monkeypatch.setattr(_prepared, "compose_stream", count_ahead)
    monkeypatch.setattr(_prepared, "DELAY_S", 0.0)
    service = await open_service(tmp_path)

    async def prepared() -> Any:
        lines = await _prepare_ended(service)
        assert lines.state == "ready"
        return lines

    try:
        for events in _scenario():
            await service.append(*events)
        await service.checkpoint()
        first = await prepared()
        await service.append(
            f.started("g", seq=1),
            f.boundary("g", "seed", {"turn": 1}, seq=2),
            f.ledger_row("g", "c1", [1, 2, 3]),
        )
        await service.checkpoint()
        second = await prepared()
        assert ahead == [4, 1]
        assert second.carried == 4 and set(second.lines) == set(first.lines) | {"g"}
        assert all(second.lines[e] is first.lines[e] for e in first.lines)
        restored = await service.restore()
        restore_id = restored.restore.restore_id
        lines = await service.coordinator.restore_projection_lines(service.run, restore_id)
        served = {e: line.line for e, line in (await lines.complete()).items()}
        assert set(served) == {"a", "e", "g"}
        assert served == await _replayed_lines(service, restore_id)
    finally:
        await service.close()


def _large_state_episodes(count: int) -> list[list[Event]]:
    """``count`` episodes, each with an exported session whose state is ``SPLICE_BYTES`` or
    more (a piece of its own in the line) and a small boundary state."""
    return [
        [
            f.started(f"big{i}", seq=1),
            f.session_started(f"big{i}", "s1", "exported", who=RES, seq=1),
            f.session_state(f"big{i}", "s1", {"blob": f"{i}" * SPLICE_BYTES}, who=RES, seq=2),
            f.boundary(f"big{i}", "seed", {"turn": i}, seq=2),
        ]
        for i in range(count)
    ]


async def _prepared_large_states(
    service: Any, monkeypatch: Any, read: str, count: int = 40
) -> tuple[Any, dict[str, ProjectionLine], dict[str, bytes]]:
    """``count`` large-state episodes (more than a slice) checkpointed, their prepare ended
    (its state ``ready``) and the checkpoint restored: the prepare, its lines and the lines served. With
    ``read="copied"`` the log gives copies to the composition (as Kafka's does)."""
    monkeypatch.setattr(_prepared, "DELAY_S", 0.0)
    if read == "copied":
        monkeypatch.setattr(service.log, "read_pages_in_place", service.log.read_pages)
    for events in _large_state_episodes(count):
        await service.append(*events)
    await service.checkpoint()
    prepared = await _prepare_ended(service)
    assert prepared.state == "ready" and len(prepared.lines) == count
    kept = dict(prepared.lines)  # (the restore takes them)
    restored = await service.restore()
    restore_id = restored.restore.restore_id
    lines = await service.coordinator.restore_projection_lines(service.run, restore_id)
    served = {e: line.line for e, line in (await lines.complete()).items()}
    assert served == await _replayed_lines(service, restore_id)  # byte for byte
    return prepared, kept, served


@pytest.mark.parametrize("read", ["in place", "copied"])
async def test_a_prepare_keeps_large_states_mapped_from_files_not_on_the_heap(
    service: Any, tmp_path: Path, monkeypatch: Any, read: str
) -> None:
    """Each prepared line's large state is a view of a file's mapping: the embedded log's blob
    file it was read from in place, or, from a log that copies (Kafka's, and the embedded one
    made to copy), a file of its own that the prepare wrote and no directory names. The budget
    counts only what the heap holds, so a checkpoint of states larger than it is prepared; its
    restore serves a replay's lines."""
    spill = tmp_path / "spill"
    spill.mkdir()
    service.coordinator.preparer.spill_dir = str(spill)
    prepared, lines, served = await _prepared_large_states(service, monkeypatch, read)
    large = [piece for line in lines.values() for piece in line.pieces[1:] if len(piece) > 1000]
    assert len(large) == 40 and all(mapped(piece) for piece in large)
    assert prepared.size_bytes < sum(map(len, large)) // 10
    if read == "copied" or service.log.url.startswith("kafka"):
        # A file (and a mapping) per line, named in no directory.
        assert len({id(piece.obj) for piece in large}) == 40
    assert list(spill.iterdir()) == []
    assert len(served) == 40


@pytest.mark.parametrize("fault", ["missing directory", "short of room"])
async def test_a_prepare_that_cannot_keep_large_states_in_a_file_keeps_them_in_memory(
    tmp_path: Path, monkeypatch: Any, fault: str
) -> None:
    """The prepare's directory is gone, or its disk would keep less than the reserve free:
    the large states stay on the heap (the budget decides, as before files), and the restore
    still serves a replay's lines; once the fault ends, the next prepare keeps them in files."""
    service = await open_service(tmp_path)
    try:
        if fault == "missing directory":
            service.coordinator.preparer.spill_dir = str(tmp_path / "gone")
        else:
            total = shutil.disk_usage(tmp_path).total
            monkeypatch.setattr(_prepared, "SPILL_RESERVE_BYTES", total)
        prepared, lines, served = await _prepared_large_states(service, monkeypatch, "copied")
        pieces = [p for line in lines.values() for p in line.pieces[1:] if len(p) > 1000]
        assert len(pieces) == 40 and not any(mapped(piece) for piece in pieces)
        assert prepared.size_bytes > sum(map(len, pieces))
        assert len(served) == 40
        # The fault ends: the next checkpoint's prepare keeps them in files again.
        monkeypatch.setattr(_prepared, "SPILL_RESERVE_BYTES", 0)
        service.coordinator.preparer.spill_dir = None
        await service.checkpoint()
        again = await _prepare_ended(service)
        assert again.state == "ready" and len(again.lines) == 40
        large = [p for line in again.lines.values() for p in line.pieces[1:] if len(p) > 1000]
        assert len(large) == 40 and all(mapped(piece) for piece in large)
    finally:
        await service.close()


async def test_a_service_that_stops_ends_its_prepares(tmp_path: Path) -> None:
    """A prepare waiting for its start when the service stops ends with it."""
    service = await open_service(tmp_path)
    for events in _scenario():
        await service.append(*events)
    await service.checkpoint()
    task = service.coordinator.preparer.status()[service.run].task
    assert task is not None and not task.done()
    await service.close()
    assert task.cancelled() and not service.coordinator.preparer.status()


async def _checkpoint_prepared(service: Any) -> Any:
    """The scenario's episodes appended, then a checkpoint whose lines are prepared; the run's
    projector."""
    for events in _scenario():
        await service.append(*events)
    await service.checkpoint()
    assert (await _prepare_ended(service)).state == "ready"
    return await service.coordinator.projector(service.run)


async def test_a_restore_that_replies_before_its_resets_folds_the_new_attempts_on_them(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The REST route's restore (``settle_after``) returns once its plan is committed, before
    the projector has its resets (they come while the prepared lines are handed over, and its
    fold waits for them): the new attempts' records appended at once are folded on the reset
    state, and the restore serves a replay's lines."""
    monkeypatch.setattr(_prepared, "DELAY_S", 0.0)
    service = await open_service(tmp_path)
    try:
        projector = await _checkpoint_prepared(service)
        restored = await service.restore(settle_after=True)
        restore_id = restored.restore.restore_id
        assert projector.pending_restores == [restore_id]  # replied before the resets
        assert projector.trackers["a"].attempt == 0
        await service.append(f.boundary("a", "close_agent", {"turn": 2}, attempt=1))
        lines = await service.coordinator.restore_projection_lines(service.run, restore_id)
        served = {e: line.line for e, line in (await lines.complete()).items()}
        assert not projector.pending_restores and projector.trackers["a"].attempt == 1
        assert set(served) == {"a", "e"}
        assert served == await _replayed_lines(service, restore_id)
        after = await service.checkpoint()
        projection = await service.coordinator.checkpoint_projection(
            service.run, after.checkpoint.checkpoint_id, "a"
        )
        assert projection.attempt == 1
        assert projection.boundaries["environment"].state.value() == {"turn": 2}
        assert len(projection.ledger) == 1  # the continued prefix, under the new attempt
    finally:
        await service.close()


async def test_a_restore_whose_lines_fail_before_its_resets_still_gives_them(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The build of a restore's lines fails while it hands the prepared lines over, before the
    resets (made to happen here): the projector still takes them and folds on, and the next
    fetch serves a replay's lines."""
    monkeypatch.setattr(_prepared, "DELAY_S", 0.0)

    def broken(self: ProjectionLine, attempt: int, *, was: int) -> ProjectionLine:
        raise RuntimeError("the build broke")

    service = await open_service(tmp_path)
    try:
        projector = await _checkpoint_prepared(service)
        with monkeypatch.context() as patched:
            patched.setattr(ProjectionLine, "as_attempt", broken)
            restored = await service.restore(settle_after=True)
            restore_id = restored.restore.restore_id
            lines = await service.coordinator.restore_projection_lines(service.run, restore_id)
            with pytest.raises(RuntimeError, match="the build broke"):
                await lines.complete()
        assert not projector.pending_restores
        assert {projector.trackers[e].attempt for e in ("a", "e")} == {1}
        await service.append(f.boundary("a", "close_agent", {"turn": 2}, attempt=1))
        again = await service.coordinator.restore_projection_lines(service.run, restore_id)
        assert again is not lines
        served = {e: line.line for e, line in (await again.complete()).items()}
        assert set(served) == {"a", "e"}
        assert served == await _replayed_lines(service, restore_id)
        after = await service.checkpoint()
        projection = await service.coordinator.checkpoint_projection(
            service.run, after.checkpoint.checkpoint_id, "a"
        )
        assert projection.boundaries["environment"].state.value() == {"turn": 2}
    finally:
        await service.close()
