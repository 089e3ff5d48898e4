"""Checkpoints and restores end to end over the embedded log and a SQLite catalog, including the
seed's hard cases."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.errors import StaleController, UnknownCheckpoint, UnknownEpisode
from rolloutlog.log import validate_event
from rolloutlog.projections import CheckpointResult
from tests import factories as f
from tests.projections.conftest import Service, open_service


async def manifest(service: Service, checkpoint_id: int) -> dict[str, tuple[str, int]]:
    entries = await service.catalog.load_manifest(service.run, checkpoint_id)
    return {e.episode: (e.action, e.cut_offset) for e in entries}


async def committed(service: Service, **kw: object) -> CheckpointResult:
    result = await service.checkpoint(**kw)
    assert isinstance(result, CheckpointResult)
    return result


async def test_checkpoint_sorts_episodes_into_continue_restart_finished(service: Service) -> None:
    await service.append(f.started("a"), f.boundary("a", "seed", {"t": 1}))
    await service.append(f.started("b"), f.boundary("b", "verify"), f.finished("b"))
    await service.append(
        f.started("c"), f.session_started("c", "s1", "restart_only"), f.boundary("c")
    )
    await service.append(f.started("d"), f.session_started("d", "s1", "exported"), f.boundary("d"))
    result = await committed(service)
    assert result.checkpoint.status == "committed"
    assert result.checkpoint.counts == {"continue": 2, "restart": 1, "finished": 1}
    actions = {
        e: a for e, (a, _) in (await manifest(service, result.checkpoint.checkpoint_id)).items()
    }
    assert actions == {"a": "continue", "b": "finished", "c": "restart", "d": "continue"}
    assert set(result.timings_ms) >= {"begin", "markers", "projector", "commit", "total"}


async def test_replay_from_is_the_earliest_offset_a_live_episode_needs(service: Service) -> None:
    [first] = await service.append(f.started("a"))
    await service.append(f.boundary("a"))
    result = await committed(service)
    offsets = {o.partition: o for o in result.checkpoint.offsets}
    assert offsets[first.partition].replay_from == first.offset
    for partition, o in offsets.items():
        if partition != first.partition:
            assert o.replay_from == o.marker


async def test_finished_episodes_are_reported_once(service: Service) -> None:
    await service.append(f.started("b"), f.boundary("b"), f.finished("b"))
    first = await committed(service)
    second = await committed(service)
    assert first.checkpoint.counts["finished"] == 1
    assert second.checkpoint.counts["finished"] == 0
    assert "b" not in await manifest(service, second.checkpoint.checkpoint_id)


async def test_restore_continues_from_the_last_boundary(service: Service) -> None:
    await service.append(
        f.started("a"),
        f.boundary("a", "seed", {"turn": 1}),
        f.step_started("a", "invoke_agent", "replay"),
        f.boundary("a", "invoke_agent", {"turn": 2}),
        f.session_state("a", "s9", {"counter": 7}),  # in the tail: dropped
    )
    checkpoint = await committed(service)
    result = await service.restore()
    assert result.restore.checkpoint_id == checkpoint.checkpoint.checkpoint_id
    assert result.restore.counts == {"continue": 1, "restart": 0, "excluded": 0}
    [entry] = result.entries
    assert (entry.previous_attempt, entry.attempt, entry.capture_key) == (0, 1, "a-a1")
    projection = (await service.coordinator.restore_projections("run", result.restore.restore_id))[
        "a"
    ]
    assert projection.attempt == 1
    assert projection.capture_key == "a-a1"
    assert projection.boundaries["environment"].stage == "invoke_agent"
    assert projection.boundaries["environment"].state.value() == {"turn": 2}
    assert projection.sessions == {}
    assert await service.catalog.current_attempts("run") == {"a": 1}


async def test_old_attempts_are_fenced_after_a_restore(service: Service) -> None:
    await service.append(f.started("a"), f.boundary("a", "seed", {"turn": 1}))
    await committed(service)
    await service.restore()
    await service.append(
        f.boundary("a", "zombie", {"turn": "old attempt"}, attempt=0),
        f.boundary("a", "invoke_agent", {"turn": 2}, attempt=1),
    )
    second = await committed(service)
    assert (await manifest(service, second.checkpoint.checkpoint_id))["a"][0] == "continue"
    again = await service.restore()
    projection = (await service.coordinator.restore_projections("run", again.restore.restore_id))[
        "a"
    ]
    assert projection.attempt == 2
    assert projection.boundaries["environment"].state.value() == {"turn": 2}


async def test_second_crash_before_the_replacement_starts_still_continues(service: Service) -> None:
    await service.append(
        f.started("a"),
        f.ledger_row("a", "c1", [1, 2, 3]),
        f.boundary("a", "seed", {"turn": 1}),
        f.chunk("a", "c2", 0, 8),
    )
    await committed(service)
    first = await service.restore()
    await committed(service)  # nothing happened in attempt 1
    second = await service.restore()
    [entry] = second.entries
    assert (entry.action, entry.previous_attempt, entry.attempt) == ("continue", 1, 2), entry
    projection = (await service.coordinator.restore_projections("run", second.restore.restore_id))[
        "a"
    ]
    restored = (await service.coordinator.restore_projections("run", first.restore.restore_id))["a"]
    assert projection.boundaries == restored.boundaries
    # The unconsumed generation cut survives the second checkpoint.
    assert projection.generation_cut is not None
    assert projection.generation_cut.token_ids == tuple(range(8))


async def test_second_checkpoint_continues_from_the_replacements_newer_state(
    service: Service,
) -> None:
    await service.append(f.started("a"), f.boundary("a", "seed", {"turn": 1}))
    await committed(service)
    await service.restore()
    await service.append(f.boundary("a", "invoke_agent", {"turn": 2}, attempt=1))
    await committed(service)
    result = await service.restore()
    projection = (await service.coordinator.restore_projections("run", result.restore.restore_id))[
        "a"
    ]
    assert projection.boundaries["environment"].stage == "invoke_agent"


async def test_an_episode_finishing_during_a_checkpoint_is_neither_lost_nor_redone(
    service: Service,
) -> None:
    await service.append(f.started("early"), f.boundary("early"), f.finished("early"))
    await service.append(f.started("late"), f.boundary("late"))
    first = await committed(service)
    await service.append(f.finished("late"))  # after the marker
    actions = await manifest(service, first.checkpoint.checkpoint_id)
    assert actions["early"][0] == "finished"
    assert actions["late"][0] == "continue"
    restore = await service.restore(exclude=["late"])  # the trainer holds late's result
    assert {e.episode: e.action for e in restore.entries} == {"late": "excluded"}
    second = await committed(service)
    assert await manifest(service, second.checkpoint.checkpoint_id) == {}


async def test_an_excluded_episode_leaves_nothing_behind(service: Service) -> None:
    await service.append(f.started("a"), f.boundary("a"))
    await service.append(f.started("b"), f.boundary("b"))
    await committed(service)
    result = await service.restore(exclude=["a"])
    assert {e.episode: e.action for e in result.entries} == {"a": "excluded", "b": "continue"}
    assert "a" not in await service.coordinator.restore_projections(
        "run", result.restore.restore_id
    )
    await service.append(f.boundary("a", "zombie", attempt=0), f.boundary("a", "zombie", attempt=1))
    second = await committed(service)
    assert set(await manifest(service, second.checkpoint.checkpoint_id)) == {"b"}


async def test_an_episode_begun_after_the_markers_restarts_and_its_dead_events_are_fenced(
    service: Service,
) -> None:
    await service.append(f.started("a"), f.boundary("a", "seed", {"turn": 1}))
    checkpoint = await committed(service)
    # Dispatched after the checkpoint, then the crash: the checkpoint does not hold it.
    await service.append(
        f.started("late"),
        f.session_started("late", "s1", "exported"),
        f.session_state("late", "s1", {"counter": 5}, who=f.participant("resources", "res-0")),
        f.boundary("late", "seed", {"turn": "dead"}),
    )
    restored = await service.restore()
    entries = {e.episode: (e.action, e.previous_attempt, e.attempt) for e in restored.entries}
    assert entries == {"a": ("continue", 0, 1), "late": ("restart", 0, 1)}
    [late] = [e for e in restored.entries if e.episode == "late"]
    assert (
        late.reason
        == f"began after the markers of checkpoint {checkpoint.checkpoint.checkpoint_id}"
    )
    assert restored.restore.counts == {"continue": 1, "restart": 1, "excluded": 0}
    # The dead attempt 0 is fenced; attempt 1 starts over from the task and owes nothing to it.
    await service.append(
        f.boundary("late", "zombie", {"turn": "dead"}, attempt=0),
        f.started("late", attempt=1),
        f.boundary("late", "seed", {"turn": "new"}, attempt=1),
    )
    second = await committed(service)
    assert (await manifest(service, second.checkpoint.checkpoint_id))["late"][0] == "continue"
    again = await service.restore()
    projection = (await service.coordinator.restore_projections("run", again.restore.restore_id))[
        "late"
    ]
    assert projection.attempt == 2
    assert projection.boundaries["environment"].state.value() == {"turn": "new"}
    assert projection.sessions == {}


async def test_an_episode_begun_after_the_markers_can_be_excluded(service: Service) -> None:
    await service.append(f.started("a"), f.boundary("a"))
    await committed(service)
    await service.append(f.started("late"), f.boundary("late"), f.finished("late"))
    restored = await service.restore(exclude=["late"])  # the trainer holds its result
    assert {e.episode: e.action for e in restored.entries} == {
        "a": "continue",
        "late": "excluded",
    }
    second = await committed(service)
    assert set(await manifest(service, second.checkpoint.checkpoint_id)) == {"a"}


async def test_excluding_an_unknown_episode_is_refused(service: Service) -> None:
    await service.append(f.started("a"), f.boundary("a"))
    await committed(service)
    with pytest.raises(UnknownEpisode):
        await service.restore(exclude=["nope"])
    assert await service.catalog.current_attempts("run") == {}


async def test_a_wait_mode_step_in_flight_is_waited_for(service: Service) -> None:
    await service.append(
        f.started("a"), f.boundary("a", "close_agent"), f.step_started("a", "verify", "wait")
    )
    task = asyncio.create_task(service.checkpoint(deadline_s=30))
    await asyncio.sleep(0.2)
    assert not task.done()
    [boundary] = await service.append(f.boundary("a", "verify", {"verified": True}))
    result = await task
    assert isinstance(result, CheckpointResult)
    action, cut = (await manifest(service, result.checkpoint.checkpoint_id))["a"]
    assert (action, cut) == ("continue", boundary.offset + 1)
    restore = await service.restore()
    projection = (await service.coordinator.restore_projections("run", restore.restore.restore_id))[
        "a"
    ]
    assert projection.boundaries["environment"].stage == "verify"


async def test_a_replay_mode_step_in_flight_is_replayed(service: Service) -> None:
    await service.append(
        f.started("a"), f.boundary("a", "close_agent"), f.step_started("a", "verify", "replay")
    )
    result = await committed(service, deadline_s=30)
    restore = await service.restore()
    projection = (await service.coordinator.restore_projections("run", restore.restore.restore_id))[
        "a"
    ]
    assert projection.boundaries["environment"].stage == "close_agent"
    assert result.checkpoint.counts["continue"] == 1


async def test_a_pending_checkpoint_commits_when_the_wait_resolves(service: Service) -> None:
    await service.append(f.started("a"), f.boundary("a"), f.step_started("a", "verify", "wait"))
    checkpoint_id = await service.checkpoint(wait=False)
    assert isinstance(checkpoint_id, int)
    assert (await service.catalog.get_checkpoint("run", checkpoint_id)).status == "pending"
    await service.append(f.boundary("a", "verify"))
    for _ in range(100):
        if (await service.catalog.get_checkpoint("run", checkpoint_id)).status == "committed":
            break
        await asyncio.sleep(0.02)
    assert (await service.catalog.get_checkpoint("run", checkpoint_id)).status == "committed"


async def test_a_wait_past_its_deadline_restarts_the_episode(service: Service) -> None:
    await service.append(f.started("a"), f.boundary("a"), f.step_started("a", "verify", "wait"))
    await service.append(f.started("b"), f.boundary("b"))
    result = await committed(service, deadline_s=0.2)
    actions = await manifest(service, result.checkpoint.checkpoint_id)
    assert actions["a"][0] == "restart"
    assert actions["b"][0] == "continue"


async def test_a_restore_that_fails_commits_nothing(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    await service.append(f.started("a"), f.boundary("a", "seed"))
    await committed(service)

    async def broken(*args: object, **kw: object) -> None:
        raise RuntimeError("catalog went away")

    monkeypatch.setattr(service.catalog, "commit_restore", broken)
    with pytest.raises(RuntimeError):
        await service.restore()
    monkeypatch.undo()
    # (The feeder may have recorded the episode meanwhile, at attempt 0.)
    assert set((await service.catalog.current_attempts("run")).values()) <= {0}
    # The old attempt is still current: its events count, and the next restore makes attempt 1.
    await service.append(f.boundary("a", "invoke_agent", attempt=0))
    await committed(service)
    result = await service.restore()
    [entry] = result.entries
    assert (entry.previous_attempt, entry.attempt) == (0, 1)
    projection = (await service.coordinator.restore_projections("run", result.restore.restore_id))[
        "a"
    ]
    assert projection.boundaries["environment"].stage == "invoke_agent"


async def test_verification_failure_restarts_instead_of_continuing(service: Service) -> None:
    good = f.ledger_row("a", "c1", [1, 2, 3])
    bad = f.envelope(
        "ledger.row",
        "a",
        {
            **good.data.model_dump(),
            "call_id": "c2",
            "parent_call_id": "c1",
            "prev_len": 3,
            "token_ids": [4],
            "cum_len": 4,
            "digest": "0" * 64,
        },
        who=f.participant("policy", "policy-0"),
    )
    await service.append(f.started("a"), good, validate_event(bad), f.boundary("a"))
    await service.append(f.started("b"), f.boundary("b"))
    await committed(service)
    result = await service.restore()
    plan = {e.episode: e for e in result.entries}
    assert plan["a"].action == "restart"
    assert "digest" in (plan["a"].reason or "")
    assert plan["b"].action == "continue"


async def test_policy_lag_drops_old_cuts_and_restarts_old_ledgers(service: Service) -> None:
    await service.append(f.started("a"), f.ledger_row("a", "c1", [1]), f.boundary("a"))
    await service.append(
        f.started("b"),
        f.ledger_row("b", "c1", [1], policy_version=4),
        f.boundary("b"),
        f.chunk("b", "c2", 0, 4),  # generated under policy version 1: older than 5 - 2
    )
    await committed(service)
    result = await service.restore(policy_version=5, max_policy_lag=2)
    plan = {e.episode: e for e in result.entries}
    assert plan["a"].action == "restart"
    assert "policy" in (plan["a"].reason or "")
    assert plan["b"].action == "continue"
    projection = (await service.coordinator.restore_projections("run", result.restore.restore_id))[
        "b"
    ]
    assert projection.generation_cut is None


async def test_stale_controller_is_refused(service: Service) -> None:
    old = service.epoch
    service.epoch = await service.catalog.take_over_controller("run")
    with pytest.raises(StaleController):
        await service.coordinator.checkpoint("run", old)
    await committed(service)
    with pytest.raises(StaleController):
        await service.coordinator.restore("run", old)


async def test_restore_of_an_expired_checkpoint_is_refused(service: Service) -> None:
    await service.append(f.started("a"), f.boundary("a"))
    first = await committed(service)
    await committed(service)
    await committed(service)  # keep 2: the first expires
    with pytest.raises(UnknownCheckpoint):
        await service.restore(checkpoint_id=first.checkpoint.checkpoint_id)


async def test_a_restarted_service_rebuilds_and_serves_the_same_projections(
    tmp_path: Path, deployment: dict[str, Any]
) -> None:
    service = await open_service(tmp_path, **deployment)
    try:
        await service.append(f.started("a"), f.boundary("a", "seed", {"turn": 1}))
        await service.append(f.started("b"), f.boundary("b"), f.finished("b"))
        await committed(service)
        result = await service.restore()
        before = await service.coordinator.restore_projections("run", result.restore.restore_id)
        await service.append(f.boundary("a", "invoke_agent", {"turn": 2}, attempt=1))
    finally:
        await service.close()
    service = await open_service(tmp_path, **deployment)
    try:
        after = await service.coordinator.restore_projections("run", result.restore.restore_id)
        assert after == before
        second = await committed(service)
        actions = await manifest(service, second.checkpoint.checkpoint_id)
        assert set(actions) == {"a"}
        again = await service.restore()
        projection = (
            await service.coordinator.restore_projections("run", again.restore.restore_id)
        )["a"]
        assert (projection.attempt, projection.boundaries["environment"].stage) == (
            2,
            "invoke_agent",
        )
    finally:
        await service.close()


async def test_a_restarted_episode_continues_across_a_service_restart(
    tmp_path: Path, deployment: dict[str, Any]
) -> None:
    service = await open_service(tmp_path, **deployment)
    try:
        await service.append(f.started("a"), f.boundary("a"))
        # Its checkpoint says restart (a restart-only session): attempt 1 starts over.
        await service.append(
            f.started("r"), f.session_started("r", "s1", "restart_only"), f.boundary("r")
        )
        await committed(service)
        first = await service.restore()
        assert {e.episode: e.action for e in first.entries} == {"a": "continue", "r": "restart"}
        await committed(service)  # moves replay_from past r's restart record
        await service.append(
            f.started("r", attempt=1), f.boundary("r", "seed", {"turn": "again"}, attempt=1)
        )
    finally:
        await service.close()
    # The restarted service's projector starts after r's restart record: r's records are all
    # of attempt 1, which the restore made current.
    service = await open_service(tmp_path, **deployment)
    try:
        second = await committed(service)
        assert (await manifest(service, second.checkpoint.checkpoint_id))["r"][0] == "continue"
        again = await service.restore()
        assert {e.episode: (e.action, e.attempt) for e in again.entries} == {
            "a": ("continue", 2),
            "r": ("continue", 2),
        }
        projection = (
            await service.coordinator.restore_projections("run", again.restore.restore_id)
        )["r"]
        assert projection.boundaries["environment"].state.value() == {"turn": "again"}
    finally:
        await service.close()


async def test_the_read_doors_answer_what_the_projector_tracks(service: Service) -> None:
    """The API asks these instead of reaching into the projector."""
    coordinator, run = service.coordinator, service.run
    who = f.participant("environment", "env-9", 1)
    await service.append(
        f.started("a", who=who, seq=1),
        f.boundary("a", who=who, seq=2),
        f.started("b", who=who, seq=3),
        f.finished("b", who=who, seq=4),
    )
    await (await coordinator.projector(run)).wait_until(
        dict(enumerate(await service.log.end_offsets(run))), timeout_s=10
    )
    tracked = {e.episode: e for e in coordinator.tracked_episodes(run)}
    assert {name: (e.attempt, e.status) for name, e in tracked.items()} == {
        "a": (0, "running"),
        "b": (0, "finished"),
    }
    assert tracked["a"].first_offset is not None and tracked["a"].started_at is not None
    assert coordinator.live_episode_count(run) == 1
    assert coordinator.tracked_bytes(run) > 0
    assert coordinator.current_attempt(run, "a") == 0
    assert coordinator.current_attempt(run, "nope") is None
    assert coordinator.highest_seq(run, ("env-9", 1)) == 4
    assert coordinator.run_events_applied(run) >= 4
    assert coordinator.run_health(run) is not None
    await committed(service)
    restore = await service.restore(exclude=["a"])
    assert [(e.episode, e.action) for e in restore.entries] == [("a", "excluded")]
    assert coordinator.is_retired(run, "a")  # excluded
    assert coordinator.is_retired(run, "b")  # reported finished by the checkpoint
    # A run this service does not follow: nothing tracked, nothing failed.
    assert coordinator.tracked_episodes("other") == []
    assert coordinator.live_episode_count("other") is None
    assert coordinator.run_health("other") is None


async def test_the_feeders_take_and_put_back_through_the_projector(service: Service) -> None:
    """A batch the catalog did not take goes back in front of the queue, in order."""
    projector = await service.coordinator.projector(service.run)
    await service.append(f.started("a"), f.started("b"), f.finished("a"))
    await projector.wait_until(
        dict(enumerate(await service.log.end_offsets(service.run))), timeout_s=10
    )
    queued = projector.take_new_episodes(100)  # everything not recorded yet (maybe nothing)
    projector.put_back_new_episodes(*queued)
    first = projector.take_new_episodes(1)
    assert (first[0], first[1]) == (queued[0][:1], queued[1][:1])
    rest = projector.take_new_episodes(100)
    assert (first[0] + rest[0], first[1] + rest[1]) == queued
    assert not projector.has_new_episodes()
    projector.put_back_new_episodes(*rest)
    projector.put_back_new_episodes(*first)
    assert projector.take_new_episodes(100) == queued
