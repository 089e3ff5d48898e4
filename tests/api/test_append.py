"""``POST /v1/runs/{run}/events``: success, and every kind of bad input refused with its code and
nothing appended."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from rolloutlog.api._prepare import parse_body
from tests import factories as f
from tests.api.conftest import RUN, Api, bearer, open_api, settings_for, wire

EVENTS = f"/v1/runs/{RUN}/events"


async def post(api: Api, content: bytes, content_type: str = "application/json") -> Any:
    return await api.client.post(
        EVENTS, content=content, headers={**bearer("participant"), "Content-Type": content_type}
    )


async def test_append_returns_offsets_in_input_order(api: Api) -> None:
    await api.seed([])
    events = [f.started(f"e{i}") for i in range(10)]
    response = await api.append(*events)
    offsets = response.json()["offsets"]
    assert len(offsets) == 10
    ends = await api.log_ends()
    assert sum(ends) == 10
    seen = {(o["partition"], o["offset"]) for o in offsets}
    assert len(seen) == 10
    # Each episode's event lands in its partition, in the order it was sent.
    for o in offsets:
        assert 0 <= o["partition"] < 4
        assert o["offset"] < ends[o["partition"]]


async def test_ndjson_body(api: Api) -> None:
    await api.seed([])
    lines = b"\n".join(orjson.dumps(e) for e in wire(f.started("a"), f.boundary("a"))) + b"\n\n"
    response = await post(api, lines, "application/x-ndjson")
    assert response.status_code == 200, response.text
    assert len(response.json()["offsets"]) == 2


async def test_empty_batch_appends_nothing(api: Api) -> None:
    await api.seed([])
    response = await post(api, b"[]")
    assert response.status_code == 200
    assert response.json() == {"offsets": []}


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _event(**changes: Any) -> dict[str, Any]:
    [event] = wire(f.boundary("a", "seed", {"turn": 1}))
    for key, value in changes.items():
        if key.startswith("data."):
            event["data"][key[5:]] = value
        elif value is _DROP:
            del event[key]
        else:
            event[key] = value
    return event


_DROP = object()


def _body(*events: dict[str, Any]) -> bytes:
    return orjson.dumps(list(events))


BAD_BODIES: list[Any] = [
    pytest.param(b'[{"v": 1, "type": ', "invalid_event", 422, id="malformed-json"),
    pytest.param(b"", "invalid_event", 422, id="empty-body"),
    pytest.param(b'{"v": 1}', "invalid_request", 400, id="not-an-array"),
    pytest.param(_body(_event(seq="12")), "invalid_event", 422, id="wrong-type-seq"),
    pytest.param(_body(_event(attempt=-1)), "invalid_event", 422, id="negative-attempt"),
    pytest.param(_body(_event(type="step.teleported")), "invalid_event", 422, id="unknown-type"),
    pytest.param(_body(_event(participant=_DROP)), "invalid_event", 422, id="missing-participant"),
    pytest.param(_body(_event(**{"data.owner": None})), "invalid_event", 422, id="missing-owner"),
    pytest.param(_body(_event(episode="r17-a2")), "invalid_event", 422, id="attempt-suffix-id"),
    pytest.param(_body(_event(episode="")), "invalid_event", 422, id="empty-episode"),
    pytest.param(_body(_event(extra=1)), "invalid_event", 422, id="unknown-field"),
    pytest.param(b'[{"v": 1, "type": "step.boundary", "ts": NaN}]', "invalid_event", 422, id="nan"),
    pytest.param(_body(_event())[:-2] + b', "x": Infinity}]', "invalid_event", 422, id="infinity"),
    pytest.param(b"[\xff\xfe]", "invalid_event", 422, id="non-utf8"),
    pytest.param(
        _body(_event())[:-1].replace(b'"turn"', "\ud800".encode("utf-8", "surrogatepass")) + b"]",
        "invalid_event",
        422,
        id="lone-surrogate",
    ),
    pytest.param(_deep(5000), "invalid_event", 422, id="deep-nesting-body"),
    pytest.param(
        _body(_event())
        .replace(b'{"turn":1}', b'{"deep":' + _deep(3000) + b"}")
        .replace(b'"state":', b'"state":'),
        "invalid_event",
        422,
        id="deep-nesting-state",
    ),
    pytest.param(
        _body(_event(type="checkpoint.marker")), "invalid_event", 422, id="service-type-marker"
    ),
    pytest.param(
        _body(
            {
                **_event(type="attempt.started"),
                "data": {"restore_id": 1, "checkpoint_id": 1, "previous_attempt": 0, "cut": 0},
            }
        ),
        "invalid_event",
        422,
        id="service-type-attempt",
    ),
    pytest.param(
        _body(_event(participant={"id": "x", "kind": "service", "epoch": 1})),
        "invalid_event",
        422,
        id="service-participant",
    ),
]


@pytest.mark.parametrize(("body", "code", "status"), BAD_BODIES)
async def test_bad_input_is_refused_and_nothing_is_appended(
    api: Api, body: bytes, code: str, status: int
) -> None:
    await api.seed(["a"])
    before = await api.log_ends()
    applied = api.service.coordinator.projectors[RUN].events_applied
    # A good event first: the whole batch must be refused, not just the bad one.
    if body.startswith(b"[{") and body.endswith(b"}]"):
        body = b"[" + orjson.dumps(wire(f.boundary("a", "good"))[0]) + b"," + body[1:]
    response = await post(api, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    assert await api.log_ends() == before
    assert api.service.coordinator.projectors[RUN].events_applied == applied


async def test_the_refusal_names_the_bad_event_and_field(api: Api) -> None:
    await api.seed([])
    good = wire(f.started("a"))[0]
    response = await post(api, _body(good, good, _event(seq="x")))
    error = response.json()["error"]
    assert error["details"]["index"] == 2
    assert error["details"]["field"] == "seq"


async def test_ndjson_line_that_is_not_json_names_its_index(api: Api) -> None:
    await api.seed([])
    lines = orjson.dumps(wire(f.started("a"))[0]) + b"\n{nope\n"
    response = await post(api, lines, "application/x-ndjson")
    assert response.status_code == 422
    assert response.json()["error"]["details"]["index"] == 1
    assert sum(await api.log_ends()) == 0


async def test_huge_declared_body_is_refused_before_reading(tmp_path: Any) -> None:
    async with open_api(settings_for(tmp_path / "d", max_events_bytes=10_000)) as api:
        await api.seed([])
        response = await post(api, b"[" + b" " * 20_000 + b"]")
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "payload_too_large"
        assert sum(await api.log_ends()) == 0


async def test_huge_streamed_body_is_cut_off_at_the_limit(tmp_path: Any) -> None:
    chunks_sent = 0

    async def chunks() -> Any:
        nonlocal chunks_sent
        yield b"["
        for _ in range(1000):  # 1000 x 1 KiB, far past the 10 kB limit
            chunks_sent += 1
            yield b" " * 1024
        yield b"]"

    async with open_api(settings_for(tmp_path / "d", max_events_bytes=10_000)) as api:
        await api.seed([])
        response = await api.client.post(EVENTS, content=chunks(), headers=bearer("participant"))
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "payload_too_large"
        assert sum(await api.log_ends()) == 0


async def test_a_single_event_over_the_record_limit_is_refused(tmp_path: Any) -> None:
    settings = settings_for(
        tmp_path / "d", log_url=f"embedded://{tmp_path}/d?max_record_bytes=4096"
    )
    async with open_api(settings) as api:
        await api.seed([])
        response = await api.append(f.boundary("a", "big", {"blob": "x" * 10_000}), expect=413)
        assert response.json()["error"]["code"] == "payload_too_large"
        assert sum(await api.log_ends()) == 0


async def test_unknown_run(api: Api) -> None:
    response = await api.call("POST", "/v1/runs/nope/events", "participant", 404, json=[])
    assert response.json()["error"]["code"] == "unknown_run"


async def test_fenced_attempt_is_refused_whole(api: Api) -> None:
    await api.seed(["a", "b"])
    await api.checkpoint()
    await api.restore()
    before = await api.log_ends()
    response = await api.append(
        f.boundary("b", "ok", attempt=1), f.boundary("a", "zombie", attempt=0), expect=409
    )
    error = response.json()["error"]
    assert error["code"] == "attempt_fenced"
    assert error["details"] == {"index": 1, "episode": "a", "attempt": 0, "current_attempt": 1}
    assert await api.log_ends() == before
    await api.append(f.boundary("a", "new", attempt=1))


async def test_fenced_participant_epoch_is_refused(api: Api) -> None:
    await api.seed(["a"])
    assert await api.register() == 2  # env-0 restarted: epoch 2
    before = await api.log_ends()
    response = await api.append(f.boundary("a", "zombie"), expect=409)  # still epoch 1
    error = response.json()["error"]
    assert error["code"] == "participant_fenced"
    assert (error["details"]["epoch"], error["details"]["registered_epoch"]) == (1, 2)
    assert await api.log_ends() == before
    await api.append(f.boundary("a", "fresh", who=f.participant(epoch=2)))


async def test_epochs_registered_elsewhere_are_learned(api: Api) -> None:
    await api.seed(["a"])
    # Another replica registers env-0 again: the catalog knows, this service's cache does not.
    await api.service.catalog.register_participant(RUN, "env-0", "environment")
    await api.append(f.boundary("a", "x", who=f.participant(epoch=2)))
    response = await api.append(f.boundary("a", "zombie"), expect=409)
    assert response.json()["error"]["code"] == "participant_fenced"
    # Again at once: a refusal reloads the registrations first (no rate limit can refuse it).
    await api.service.catalog.register_participant(RUN, "env-0", "environment")
    await api.append(f.boundary("a", "y", who=f.participant(epoch=3)))
    # An epoch nobody granted stays refused after the reload.
    response = await api.append(f.boundary("a", "z", who=f.participant(epoch=4)), expect=409)
    error = response.json()["error"]
    assert error["code"] == "participant_fenced"
    assert (error["details"]["epoch"], error["details"]["registered_epoch"]) == (4, 3)


async def test_attempts_begun_elsewhere_are_learned_and_others_refused(api: Api) -> None:
    await api.seed(["a"])
    await api.checkpoint()
    await api.restore()  # a continues as attempt 1
    # As if another replica had restored: this service's cache and projector are behind.
    api.service.fencing[RUN].attempts.clear()
    tracker = api.service.coordinator.projectors[RUN].trackers["a"]
    tracker.attempt, seen = 0, tracker.attempt
    try:
        await api.append(f.boundary("a", "next", attempt=1))
    finally:
        tracker.attempt = max(tracker.attempt, seen)
    before = await api.log_ends()
    response = await api.append(f.boundary("a", "ahead", attempt=2), expect=409)
    error = response.json()["error"]
    assert error["code"] == "attempt_fenced"
    assert (error["details"]["attempt"], error["details"]["current_attempt"]) == (2, 1)
    assert await api.log_ends() == before


async def test_an_attempt_and_an_epoch_both_begun_elsewhere_are_learned(api: Api) -> None:
    """A restore and a registration on another replica: the first check finds the attempt
    stale, the check after that reload the epoch; both are reloaded before a refusal."""
    await api.seed(["a"])
    await api.checkpoint()
    await api.restore()  # a continues as attempt 1
    api.service.fencing[RUN].attempts.clear()
    tracker = api.service.coordinator.projectors[RUN].trackers["a"]
    tracker.attempt, seen = 0, tracker.attempt
    await api.service.catalog.register_participant(RUN, "env-0", "environment")  # epoch 2
    try:
        await api.append(f.boundary("a", "next", attempt=1, who=f.participant(epoch=2)))
    finally:
        tracker.attempt = max(tracker.attempt, seen)


async def test_an_excluded_episode_takes_no_more_events(api: Api) -> None:
    await api.seed(["a", "b"])
    await api.checkpoint()
    await api.restore(exclude=["b"])
    before = await api.log_ends()
    for attempt in (0, 1):
        response = await api.append(f.boundary("b", "late", attempt=attempt), expect=409)
        assert response.json()["error"]["code"] == "attempt_fenced"
    assert await api.log_ends() == before
    await api.append(f.boundary("a", "next", attempt=1))


_CONTROL = ["\n", "\r", "\t", "\x00", "\x1b", "\u2028"]


@pytest.mark.parametrize("suffix", _CONTROL)
@pytest.mark.parametrize("where", ["episode", "participant", "owner", "stage", "session", "call"])
async def test_ids_with_a_newline_or_control_character_are_refused(
    api: Api, where: str, suffix: str
) -> None:
    await api.seed([])
    if where in ("session", "call"):
        [event] = wire(f.session_started("a") if where == "session" else f.ledger_row("a"))
        key = "session_id" if where == "session" else "call_id"
        event["data"][key] += suffix
    else:
        [event] = wire(f.boundary("a", "seed", {"turn": 1}))
        if where == "episode":
            event["episode"] += suffix
        elif where == "participant":
            event["participant"]["id"] += suffix
        else:
            event["data"][where] += suffix
    response = await post(api, orjson.dumps([event]))
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_event"
    assert sum(await api.log_ends()) == 0


async def test_names_elsewhere_are_matched_whole(api: Api) -> None:
    await api.seed([])
    refused = await api.call("POST", "/v1/runs", "trainer", 400, json={"run": "r\n"})
    assert refused.json()["error"]["code"] == "invalid_request"
    register = f"/v1/runs/{RUN}/participants"
    refused = await api.call(
        "POST", register, "participant", 400, json={"id": "env-9\n", "kind": "environment"}
    )
    assert refused.json()["error"]["code"] == "invalid_request"
    restore = await api.call(
        "POST",
        f"/v1/runs/{RUN}/restores",
        "trainer",
        400,
        json={"controller_epoch": api.epoch, "checkpoint_id": "latest", "exclude": ["a\n"]},
    )
    assert restore.json()["error"]["code"] == "invalid_request"


async def test_ids_accepted_before_are_still_accepted(api: Api) -> None:
    await api.seed([])
    for episode in ("r17", "a", "A.b_c:d-e", "x" * 200, "r17-b2", "r17-a"):
        await api.append(f.started(episode), f.boundary(episode, "seed", {"turn": 1}))
    checkpoint = (await api.checkpoint())["checkpoint_id"]
    for episode in ("r17", "A.b_c:d-e"):
        projection = await api.call(
            "GET",
            f"/v1/runs/{RUN}/episodes/{episode}/projection?checkpoint={checkpoint}",
            "participant",
            200,
        )
        assert projection.json()["episode"] == episode


def test_parse_body_accepts_crlf_ndjson() -> None:
    assert parse_body(b'{"a":1}\r\n{"b":2}\r\n', ndjson=True) == [{"a": 1}, {"b": 2}]


async def test_a_worker_process_prepares_what_the_service_process_would() -> None:
    from rolloutlog.api._prepare import Preparer, prepare
    from rolloutlog.errors import InvalidEvent

    good = orjson.dumps(wire(*(f.boundary(f"e{i}", "s", {"pad": "x" * 200}) for i in range(60))))
    bad = good[:-2] + b', "extra": 1}]'
    preparer = Preparer(workers=1)
    await preparer.start()
    try:
        assert await preparer.prepare(good, False, 4, 1 << 20) == prepare(good, False, 4, 1 << 20)
        with pytest.raises(InvalidEvent) as refused:
            await preparer.prepare(bad, False, 4, 1 << 20)
        assert refused.value.details["index"] == 59
        assert refused.value.details["field"] == "extra"
    finally:
        await preparer.stop()


async def test_big_bodies_prepared_in_slices_match_the_one_call_prepare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rolloutlog.api import _prepare
    from rolloutlog.errors import RolloutlogError

    monkeypatch.setattr(_prepare, "SLICE_BYTES", 64)  # many slices, many false splits
    events = wire(
        *(
            f.boundary(f"e{i}", "s", {"rows": [{"a": 1}, {"b": "},{"}], "t": "}, {"})
            for i in range(40)
        )
    )
    compact = orjson.dumps(events)
    spaced = b" [\n" + b" ,\r\n\t".join(orjson.dumps(e) for e in events) + b"\n] "
    ndjson = b"\n".join(orjson.dumps(e) for e in events)
    for body, is_ndjson in ((compact, False), (spaced, False), (ndjson, True), (b"[]", False)):
        expected = _prepare.prepare(body, is_ndjson, 4, 1 << 20)
        assert await _prepare.prepare_sliced(body, is_ndjson, 4, 1 << 20) == expected

    bad = [
        compact[:-1] + b",]",  # trailing comma
        compact.replace(b'"e20"', b'"e20\\n"'),  # a bad id in the middle
        compact[: len(compact) // 2],  # cut short
        compact.replace(b"},{", b"}\x0c,{", 1),  # not JSON whitespace between elements
        b'{"not": "an array"}',
        b"[1, 2]",
    ]
    for body in bad:
        try:
            _prepare.prepare(body, False, 4, 1 << 20)
        except RolloutlogError as e:
            expected_error: RolloutlogError = e
        with pytest.raises(type(expected_error)) as caught:
            await _prepare.prepare_sliced(body, False, 4, 1 << 20)
        assert caught.value.details.get("index") == expected_error.details.get("index")


async def test_the_events_route_answers_past_fastapi_with_the_same_replies(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LeanRoute`` serves appends itself (the role checked by the route's own dependency) and
    hands FastAPI only what its path pattern refuses, which FastAPI answers as before."""
    from fastapi import routing

    await api.seed([])
    solved: list[object] = []
    solve = routing.solve_dependencies

    async def counted(*args: Any, **kwargs: Any) -> Any:
        solved.append(kwargs.get("request"))
        return await solve(*args, **kwargs)

    monkeypatch.setattr(routing, "solve_dependencies", counted)
    response = await api.append(f.started("lean"))
    assert response.headers["content-type"] == "application/json"
    assert int(response.headers["content-length"]) == len(response.content)
    assert len(response.json()["offsets"]) == 1
    assert solved == []
    for headers, status, code in (
        ({}, 401, "unauthorized"),
        (bearer("analyst"), 403, "forbidden"),
        ({"Authorization": "Basic abc"}, 401, "unauthorized"),
    ):
        refused = await api.client.post(EVENTS, content=b"[]", headers=headers)
        assert (refused.status_code, refused.json()["error"]["code"]) == (status, code)
        assert ("www-authenticate" in refused.headers) == (status == 401)
    refused = await api.client.post(
        "/v1/runs/-bad/events", content=b"[]", headers=bearer("participant")
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["details"]["field"] == "path.run"
    assert len(solved) == 1  # FastAPI's own handler answered that one
    assert sum(await api.log_ends()) == 1
