"""The projector's and the coordinator's shortcuts give the answers of the long way round."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutlog.log import (
    Event,
    encode_opaque,
    encode_record,
    marker_record,
    peek_record,
    validate_event,
)
from rolloutlog.projections import CheckpointResult, EpisodeProjection, project_events
from rolloutlog.projections._fold import project_raw
from tests import factories as f
from tests.projections.both_modes import check_both_modes, follow
from tests.projections.conftest import Service, open_service


async def test_a_restores_own_records_are_skipped_yet_fence_and_continue(
    service: Service,
) -> None:
    await service.append(f.started("a"), f.boundary("a", "seed", {"t": 1}))
    await service.append(f.started("b"), f.boundary("b", "seed", {"t": 2}))
    first = await service.checkpoint()
    assert isinstance(first, CheckpointResult)
    restored = await service.restore(exclude=["b"])
    projector = service.coordinator.projectors[service.run]
    applied_before = projector.events_applied
    # The replacement attempt continues; the old attempt's late event is fenced.
    await service.append(f.boundary("a", "invoke_agent", {"t": 3}, attempt=1))
    await service.append(f.boundary("a", "verify", {"t": 4}, attempt=0))
    second = await service.checkpoint()
    assert isinstance(second, CheckpointResult)
    assert projector.events_applied > applied_before
    assert restored.restore.restore_id in projector._applied_restores
    entries = {
        e.episode: e
        for e in await service.catalog.load_manifest(service.run, second.checkpoint.checkpoint_id)
    }
    assert set(entries) == {"a"}
    assert (entries["a"].attempt, entries["a"].action, entries["a"].last_stage) == (
        1,
        "continue",
        "invoke_agent",
    )


ENV = f.participant("environment", "env-0", 1)
POLICY = f.participant("policy", "policy-0", 1)
RES = f.participant("resources", "res-0", 1)
CALLS = ["c0", "c1", "c2", "c3"]


@st.composite
def lineage_stream(draw: st.DrawFn) -> tuple[list[Event], set[int]]:
    """One episode's events with tasks, ledger rows and generation chunks, each possibly wrong
    in one of the ways a restore checks (digests, lengths, parents, chunk gaps), and restores
    (committed or not) that continue it as a new attempt at an earlier cut; with the committed
    restores."""
    seqs = {"env": 0, "policy": 0, "res": 0}
    rows: dict[str, tuple[str, int]] = {}
    events: list[Event] = []
    restores: list[int] = []
    committed: set[int] = set()
    after_restore = [0]

    attempt = [0]

    def add(kind: str, episode_type: str, data: dict[str, Any], who: dict[str, Any]) -> None:
        seqs[kind] += 1
        # Now and then an old attempt's late event (fenced once a restore committed).
        late = attempt[0] and draw(st.integers(0, 7)) == 0
        envelope = f.envelope(
            episode_type, "e", data, who=who, seq=seqs[kind], attempt=attempt[0] - late
        )
        events.append(validate_event(envelope))

    if draw(st.integers(0, 9)):
        task = {"prompt": "a"}
        add("env", "episode.started", {"task": task, "task_digest": f.task_digest(task)}, ENV)
    for _ in range(draw(st.integers(1, 14))):
        choice = draw(
            st.sampled_from(
                ["task", "row", "row", "chunk", "chunk", "boundary", "other", "restore"]
            )
        )
        if choice == "restore":
            # A restore (committed or not) continuing the episode at an earlier cut.
            restores.append(len(restores) + 1)
            data = {
                "restore_id": restores[-1],
                "checkpoint_id": restores[-1],
                "previous_attempt": attempt[0],
                # The cut of a checkpoint taken after the previous restore (a restore of an
                # older cut replays instead of continuing a pinned state: the coordinator's tests).
                "cut": draw(st.integers(after_restore[0], len(events))),
            }
            service = f.participant("service", "rolloutlog", 1)
            after_restore[0] = len(events) + 1
            if draw(st.booleans()):
                committed.add(restores[-1])
                attempt[0] += 1
            events.append(
                validate_event(
                    f.envelope(
                        "attempt.started",
                        "e",
                        data,
                        who=service,
                        seq=restores[-1],
                        attempt=attempt[0] if restores[-1] in committed else attempt[0] + 1,
                    )
                )
            )
        elif choice == "task":
            task = {"prompt": draw(st.sampled_from(["a", "b"]))}
            wrong = draw(st.booleans()) and draw(st.booleans())
            digest = f.task_digest({"prompt": "z"} if wrong else task)
            add("env", "episode.started", {"task": task, "task_digest": digest}, ENV)
        elif choice == "row":
            call = draw(st.sampled_from(CALLS))
            parent = draw(st.sampled_from([None, "missing", *rows, *rows, *rows]))
            parent_digest, parent_len = rows.get(parent or "", ("", 0))
            tokens = draw(st.lists(st.integers(0, 99), max_size=4))
            prev_len = parent_len + draw(st.sampled_from([0, 0, 0, 0, 0, 1]))
            cum_len = prev_len + len(tokens)  # the envelope itself checks this one
            wrong = draw(st.integers(0, 5)) == 0
            digest = f.ledger_digest(parent_digest, [7] if wrong else tokens)
            rows[call] = (digest, cum_len)
            data = {
                "call_id": call,
                "parent_call_id": parent,
                "fingerprint": "fp",
                "context_digest": "cd",
                "policy_version": draw(st.integers(0, 3)),
                "prev_len": prev_len,
                "token_ids": tokens,
                "cum_len": cum_len,
                "digest": digest,
                "staging_key": draw(st.sampled_from([None, f"k-{call}"])),
                "constrained": draw(st.booleans()) and draw(st.booleans()),
            }
            add("policy", "ledger.row", data, POLICY)
        elif choice == "chunk":
            data = {
                "call_id": draw(st.sampled_from(CALLS)),
                "parent_call_id": draw(st.sampled_from([None, "missing", *CALLS])),
                "request_digest": "rq",
                "start": draw(st.sampled_from([0, 0, 2, 3, 5])),
                "token_ids": draw(st.lists(st.integers(0, 99), max_size=3)),
                "policy_version": draw(st.integers(0, 3)),
                "staging_key": draw(st.sampled_from([None, "k-chunk"])),
                "done": draw(st.booleans()) and draw(st.booleans()),
            }
            add("policy", "generation.chunk", data, POLICY)
        elif choice == "boundary":
            owner = draw(st.sampled_from(["environment", "agent-1"]))
            state = draw(st.sampled_from([None, {"s": 1}, {"s": "long" * 5}]))
            data = {"owner": owner, "stage": "invoke_agent", "next": None, "state": state}
            add("env", "step.boundary", data, ENV)
        else:
            kind = draw(st.sampled_from(["session.started", "session.state", "session.ended"]))
            data = {"session_id": draw(st.sampled_from(["s1", "s2"]))}
            if kind == "session.started":
                data["mode"] = draw(st.sampled_from(["exported", "restart_only"]))
            elif kind == "session.state":
                data["state"] = {"n": draw(st.integers(0, 9))}
            add("res", kind, data, RES)
    return events, committed


@settings(max_examples=400, deadline=None)
@given(lineage_stream(), st.integers(0, 24))
def test_the_trackers_verdict_is_the_folds(stream: tuple[list[Event], set[int]], cut: int) -> None:
    events, committed = stream
    offsets = list(enumerate(events))
    # Both modes agree on the manifest entry, the verdict and the metadata, across restores.
    check_both_modes("e", offsets, cut, committed)
    tracker = follow("e", offsets, cut, committed, keep_payloads=False)
    if not any(event.type == "attempt.started" for event in events[:cut]):
        assert tracker.exact
    # A copy taken at a pin stays what it was while the tracker moves on.
    tracker.pin()
    before = (tracker.verdict(), tracker.payload_bytes(), tracker.version)
    for offset, event in enumerate(events[cut:], start=cut):
        if event.type == "attempt.started":
            continue
        record = encode_record(event)
        meta, start = peek_record(record)
        tracker.observe(offset, meta, record, start)
    state = tracker.pinned_state()
    assert (state.verdict(), state.payload_bytes(), state.version) == before


def _scenario() -> list[list[Event]]:
    """Episodes a restore judges differently: good lineage with a generation cut in flight, a
    wrong digest, a chunk gap, a restart_only session, a pending session state in the tail."""
    c1 = {"call_id": "c1", "cum_len": 3, "digest": f.ledger_digest("", [1, 2, 3])}
    bad = f.ledger_row("b", "c1", [1, 2, 3]).data.model_dump()
    bad["digest"] = "0" * 64
    return [
        [
            f.started("a"),
            f.ledger_row("a", "c1", [1, 2, 3]),
            f.boundary("a", "invoke_agent", {"turn": 1}),
            f.step_started("a", "invoke_agent", "replay"),
            f.chunk("a", "c2", 0, 4),
            f.chunk("a", "c2", 4, 4),
        ],
        [
            f.started("b"),
            validate_event(
                f.envelope("ledger.row", "b", bad, who=f.participant("policy", "policy-0"))
            ),
            f.boundary("b"),
        ],
        [
            f.started("c"),
            f.ledger_row("c", "c1", [1, 2, 3]),
            f.boundary("c"),
            f.chunk("c", "c2", 0, 2),
            f.chunk("c", "c2", 5, 2),
        ],
        [f.started("d"), f.session_started("d", "s1", "restart_only"), f.boundary("d")],
        [
            f.started("e"),
            f.session_started("e", "s1", "exported"),
            f.boundary("e", "seed", {"turn": 1}),
            f.session_state("e", "s1", {"n": 2}),
            f.ledger_row("e", "c2", [4], parent=c1),
        ],
    ]


async def _restore_twice(tmp_path: Path, fast: bool) -> tuple[Any, ...]:
    service = await open_service(tmp_path)
    try:
        for events in _scenario():
            await service.append(*events)
        first = await service.checkpoint()
        assert isinstance(first, CheckpointResult)
        # A policy version no cut exceeds changes nothing but takes the replaying path.
        policy = {} if fast else {"policy_version": 10**6}
        restored = await service.restore(**policy)
        restore_id = restored.restore.restore_id
        # Either way its projection lines are built while it commits.
        assert (service.run, restore_id) in service.coordinator._restore_cache
        projections = await service.coordinator.restore_projections(service.run, restore_id)
        plan = sorted((e.episode, e.action, e.attempt, e.reason) for e in restored.entries)
        # The replacement attempts go on; the next checkpoint's manifest comes from the trackers.
        await service.append(
            f.boundary("a", "verify", {"turn": 2}, attempt=1),
            f.session_state("e", "s1", {"n": 3}, attempt=1, who=RES),
            f.boundary("e", "verify", {"turn": 3}, attempt=1),
        )
        second = await service.checkpoint()
        assert isinstance(second, CheckpointResult)
        second_id = second.checkpoint.checkpoint_id
        tracked = {
            entry.episode: entry.staging_keys
            for entry in await service.catalog.load_manifest(service.run, second_id)
            if entry.action == "continue"
        }
        folded = {
            episode: (
                await service.coordinator.checkpoint_projection(service.run, second_id, episode)
            ).staging_keys
            for episode in tracked
        }
        bodies = {
            episode: orjson.dumps(p.to_json(), default=lambda o: orjson.Fragment(o.raw))
            for episode, p in projections.items()
        }
        return plan, bodies, tracked, folded
    finally:
        await service.close()


async def test_a_restore_from_the_trackers_plans_and_serves_what_a_replay_does(
    tmp_path: Path,
) -> None:
    fast = await _restore_twice(tmp_path / "fast", fast=True)
    replayed = await _restore_twice(tmp_path / "replayed", fast=False)
    assert fast[:2] == replayed[:2]
    # After the restore the trackers keep what the fold keeps: the old attempt's tail (e's
    # undelivered call c2) is dropped and stays dropped past the new attempt's boundary, on both
    # paths (a restore that replayed resets trackers from projections, which have no tail).
    assert fast[2] == fast[3] == replayed[2] == replayed[3]
    assert fast[2]["e"] == ()
    plan = {episode: (action, reason) for episode, action, _, reason in fast[0]}
    assert plan["a"] == ("continue", None)
    assert plan["e"] == ("continue", None)
    assert plan["b"][0] == plan["c"][0] == plan["d"][0] == "restart"
    assert "digest" in plan["b"][1] and "contiguous" in plan["c"][1]


async def test_old_attempt_events_during_a_restore_stay_out_of_the_continued_state(
    service: Service,
) -> None:
    await service.append(f.started("a"), f.boundary("a", "seed", {"t": 1}))
    first = await service.checkpoint()
    assert isinstance(first, CheckpointResult)
    projector = service.coordinator.projectors[service.run]
    catalog = service.catalog
    reserve_restore_id = catalog.reserve_restore_id

    async def late_event_then_reserve(run: str, controller_epoch: int) -> int:
        # The old attempt is still current while the restore plans: its late boundary reaches
        # the (pinned) tracker, but the fold drops it (it is after the cut).
        [late] = await service.append(f.boundary("a", "late", {"t": 9}, attempt=0))
        await projector.wait_until({late.partition: late.offset + 1})
        assert projector.trackers["a"].last_stage == "late"
        return await reserve_restore_id(run, controller_epoch)

    catalog.reserve_restore_id = late_event_then_reserve  # type: ignore[method-assign]
    restored = await service.restore()
    assert [e.action for e in restored.entries] == ["continue"]
    second = await service.checkpoint()
    assert isinstance(second, CheckpointResult)
    [entry] = await catalog.load_manifest(service.run, second.checkpoint.checkpoint_id)
    folded = await service.coordinator.checkpoint_projection(
        service.run, second.checkpoint.checkpoint_id, "a"
    )
    assert folded.boundaries["environment"].stage == "seed"
    assert (entry.attempt, entry.last_stage, entry.size_bytes) == (
        1,
        "seed",
        folded.payload_bytes,
    )


# -- the record check's fast path (one generated expression per type) --------------------------


def _metadata_samples() -> list[dict[str, Any]]:
    """Well-formed metadata of every event type the factories build, and a marker."""
    events = [
        f.started("a"),
        f.boundary("a", "seed", {"t": 1}),
        f.step_started("a"),
        f.ledger_row("a", token_ids=[1, 2]),
        f.session_state("a"),
        f.chunk("a"),
        f.finished("a"),
        f.session_started("a"),
    ]
    metas = [peek_record(encode_record(event))[0] for event in events]
    metas.append(orjson.loads(marker_record(3, 1, 1.0)))
    return metas


_ODD_VALUES = [None, "x", "", 0, 1, -1, 1.5, True, False, [], {}, [1], {"a": 1}]
_LEFT_OUT = object()


def _mutants() -> list[tuple[int, str, str, Any]]:
    """Every single mutation of the samples: each field (of the envelope, its data and its
    participant) left out or set to each odd value, and an unknown field added."""
    out = []
    for index, meta in enumerate(_metadata_samples()):
        for where in ("", "data", "participant"):
            target = meta if not where else meta[where]
            for key in [*target, "unknown_field"]:
                for value in [_LEFT_OUT, *_ODD_VALUES]:
                    out.append((index, where, key, value))
    return out


def _mutate(meta: dict[str, Any], where: str, key: str, value: Any) -> None:
    target = meta if not where else meta.get(where)
    if isinstance(target, dict):
        if value is _LEFT_OUT:
            target.pop(key, None)
        else:
            target[key] = value


def test_the_record_checks_fast_path_gives_the_slow_paths_verdict() -> None:
    from rolloutlog.projections._quarantine import _problem, metadata_problem

    for index, where, key, value in _mutants():
        meta = _metadata_samples()[index]
        _mutate(meta, where, key, value)
        assert metadata_problem(meta) == _problem(meta), (index, where, key, value)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_mutants()), min_size=2, max_size=4))
def test_the_record_checks_fast_path_gives_the_slow_paths_verdict_on_mixed_mutations(
    mutations: list[tuple[int, str, str, Any]],
) -> None:
    from rolloutlog.projections._quarantine import _problem, metadata_problem

    meta = _metadata_samples()[mutations[0][0]]
    for _, where, key, value in mutations:
        _mutate(meta, where, key, value)
    assert metadata_problem(meta) == _problem(meta)


def test_the_record_checks_fast_path_accepts_what_the_slow_path_accepts() -> None:
    from rolloutlog.projections._quarantine import _problem, metadata_problem

    for meta in _metadata_samples():
        assert _problem(meta) is None
        assert metadata_problem(meta) is None
    for odd in ([1], "text", 3, None, {"type": ["unhashable"]}, {"type": "nope"}):
        assert metadata_problem(odd) == _problem(odd) is not None


@settings(max_examples=300, deadline=None)
@given(lineage_stream(), st.integers(0, 24), st.booleans())
def test_a_replay_of_raw_records_projects_what_the_typed_fold_does(
    stream: tuple[list[Event], set[int]], cut: int, quoted: bool
) -> None:
    """``project_raw`` (a restore's replay: metadata peeked, payloads left in the records)
    gives ``project_events``' projection, across restores committed or not, before or after
    the cut; a payload that spells out an ``attempt.started`` changes nothing."""
    events, committed = stream
    if quoted:  # a session state whose bytes name the restore record's type
        text = '"type":"attempt.started"'
        events = [*events, f.session_state("e", "s1", {"note": text}, who=RES, seq=99)]
    offsets = list(enumerate(events))
    expected = project_events("e", offsets, cut, committed)
    records = [(offset, encode_record(event)) for offset, event in offsets]
    got = project_raw("e", records, cut, committed)

    def seen(p: EpisodeProjection) -> tuple[Any, ...]:
        line = orjson.dumps(p.to_json(), default=encode_opaque)
        return (
            line,
            p.cut,
            p.first_offset,
            p.committed_through,
            p.events_folded,
            p.payload_bytes,
            p.staging_keys,
            dict(p.open_waits),
        )

    assert seen(got) == seen(expected)
