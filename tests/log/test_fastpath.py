"""The append's fast path (``log.fast_record``, on the envelope checker ``core/_check.py``) against pydantic, envelope by envelope: whatever
it accepts, the models accept and encode to the same record; valid envelopes of every client
type take it."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from rolloutlog.core._events import EVENT_CLASSES
from rolloutlog.errors import InvalidEvent
from rolloutlog.log import SERVICE_EVENT_TYPES, encode_event, encode_record, fast_record
from rolloutlog.log import validate_event as validate
from tests import factories as f


def _wire(event: Any) -> dict[str, Any]:
    value: dict[str, Any] = orjson.loads(encode_event(event))
    return value


def _valid() -> list[dict[str, Any]]:
    """One or more valid envelopes of every client event type, as a client sends them."""
    events = [
        _wire(f.started("r1")),
        _wire(f.step_started("r1")),
        _wire(f.boundary("r1", state={"turn": 1, "note": "x" * 40}, nxt="act")),
        _wire(f.boundary("r1", state=None)),
        _wire(f.ledger_row("r1", token_ids=[1, 2, 3])),
        _wire(f.chunk("r1")),
        _wire(f.session_started("r1", mode="checkpoint")),
        _wire(f.session_state("r1")),
        _wire(f.finished("r1", result={"score": 1})),
        _wire(f.finished("r1")),
        f.envelope(
            "session.ended", "r1", {"session_id": "s1"}, who=f.participant("resources", "res-0")
        ),
    ]
    # Defaults left out, keys in another order.
    short = {"type": "step.started", "episode": "e.2", "seq": 3, "ts": 7}
    short["participant"] = {"epoch": 0, "kind": "agent", "id": "a:1"}
    short["data"] = {"stage": "s", "owner": "o"}
    events.append(short)
    return events


def _outcome(value: Any) -> bytes | str:
    """What the models make of an envelope: its record, or the refusal's message."""
    try:
        event = validate(copy.deepcopy(value), 0)
    except InvalidEvent as e:
        return e.message
    return encode_record(event)


def _agree(value: Any) -> bool:
    """The fast path accepts only what the models accept, with the same record and keys; True
    when it took the envelope."""
    fast = fast_record(copy.deepcopy(value))
    if fast is None:
        return False
    slow = _outcome(value)
    record, episode, attempt, participant, epoch, seq = fast
    assert record == slow, value
    event = validate(copy.deepcopy(value), 0)
    assert event.type not in SERVICE_EVENT_TYPES and event.participant.kind != "service"
    who = event.participant
    assert (episode, attempt, participant, epoch, seq) == (
        event.episode,
        event.attempt,
        who.id,
        who.epoch,
        event.seq,
    )
    return True


def test_every_client_type_takes_the_fast_path() -> None:
    valid = _valid()
    assert {event["type"] for event in valid} == set(EVENT_CLASSES) - SERVICE_EVENT_TYPES
    for value in valid:
        assert _agree(value), value


_ODD: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2**53,
    2**53 + 1,
    2**63,
    -(2**63),
    0.0,
    -0.0,
    1.5,
    1e300,
    5e-324,
    "",
    "x",
    "a" * 129,
    "a" * 201,
    "ok-1",
    "r1-a3",
    "é",
    "a\nb",
    "a\x7f",
    "tab\t",
    'quote"back\\slash',
    "wait",
    "replay",
    "checkpoint",
    "service",
    "agent",
    [],
    [1, 2],
    [1, True],
    [1.0],
    {},
    {"a": 1},
]


def _paths(value: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*prefix, key)
            yield from _paths(item, (*prefix, key))


def _set(value: dict[str, Any], path: tuple[str, ...], new: Any) -> dict[str, Any]:
    out = copy.deepcopy(value)
    target = out
    for key in path[:-1]:
        target = target[key]
    if new is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = new
    return out


_DELETE = object()


def _mutants(value: dict[str, Any]) -> Iterator[Any]:
    for path in _paths(value):
        for odd in [*_ODD, _DELETE]:
            yield _set(value, path, odd)
        yield _set(value, (*path[:-1], "extra"), 1)
    yield _set(value, ("type",), "checkpoint.marker")
    yield _set(value, ("type",), "attempt.started")
    for kind in EVENT_CLASSES:
        yield _set(value, ("type",), kind)
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    yield _set(value, ("data", "task"), deep)
    yield _set(value, ("data", "state"), deep)
    yield [value]
    yield "not an envelope"


def test_mutated_envelopes_agree_with_the_models() -> None:
    taken = refused = 0
    for valid in _valid():
        for mutant in _mutants(valid):
            if _agree(mutant):
                taken += 1
            elif not isinstance(_outcome(mutant), bytes):
                refused += 1
    assert taken > 200 and refused > 1000  # both sides of the line were exercised


@pytest.mark.parametrize("seed", range(3))
def test_random_floats_and_strings_agree(seed: int) -> None:
    rng = random.Random(seed)
    base = _valid()
    for _ in range(3000):
        value = copy.deepcopy(rng.choice(base))
        number = rng.choice(
            [
                rng.uniform(-1e20, 1e20),
                rng.random() * 10 ** rng.randint(-320, 300),
                float(rng.getrandbits(64)),
                rng.randint(-(2**60), 2**60),
            ]
        )
        text = "".join(
            chr(rng.choice([rng.randint(32, 126), rng.randint(0, 0x2FFF)]))
            for _ in range(rng.randint(0, 12))
        )
        value["ts"] = number
        data = value["data"]
        for key in ("reward", "deadline_s"):
            if key in data:
                data[key] = number
        for key in ("task_digest", "fingerprint", "request_digest", "staging_key", "owner"):
            if key in data:
                data[key] = text
        _agree(value)


def test_prepare_gives_what_it_gave_before_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body mixing envelopes the fast path takes and envelopes only pydantic takes prepares
    into the same batch, and a bad envelope in it is refused with the same error, as with every
    envelope through pydantic (the former ``prepare``)."""
    from rolloutlog.api import _prepare

    events = _valid()
    events.append(_set(events[1], ("v",), True))  # pydantic only: a bool for the literal 1
    events.append(_set(events[2], ("ts",), 2**60))  # pydantic only: an int past 2^53
    events.append(_set(events[3], ("participant", "epoch"), 2))  # fast, a second epoch
    bodies = [orjson.dumps(events)]
    for index, field in ((5, ("data", "call_id")), (12, ("seq",))):
        bodies.append(orjson.dumps([*events[:index], _set(events[index], field, -1)]))
    bodies.append(orjson.dumps([*events, _set(events[0], ("type",), "attempt.started")]))
    fast = [_outcome_of(_prepare.prepare, body) for body in bodies]
    monkeypatch.setattr(_prepare, "fast_record", lambda value: None)
    slow = [_outcome_of(_prepare.prepare, body) for body in bodies]
    assert fast == slow
    assert isinstance(fast[0], _prepare.Batch) and len(fast[0].values) == len(events)
    refusals = [outcome[2].get("index") for outcome in fast[1:]]
    assert refusals == [5, 12, len(events)], fast[1:]


def _outcome_of(prepare: Any, body: bytes) -> Any:
    try:
        return prepare(body, False, 4, 1 << 20)
    except InvalidEvent as e:
        return (type(e).__name__, e.message, e.details)


def test_the_remembered_names_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from rolloutlog.core import _check

    monkeypatch.setattr(_check, "_KNOWN_MAX", 8)
    base = _valid()[2]
    for i in range(50):
        assert _agree(_set(base, ("episode",), f"bounded-{i}"))
        assert not _agree(_set(base, ("episode",), f"bounded-{i}-a1"))
    assert len(_check._EPISODES) <= 8
