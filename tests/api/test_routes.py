"""Every route of docs/design.md §8 in process: its success path and its error paths."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from rolloutlog.api._http import stream_ndjson_lines
from rolloutlog.core import SPLICE_BYTES, ProjectionLine
from tests import factories as f
from tests.api.conftest import RUN, Api, bearer

R = f"/v1/runs/{RUN}"


def ndjson(text: str) -> list[Any]:
    return [orjson.loads(line) for line in text.splitlines() if line.strip()]


def code(response: Any) -> str:
    return str(response.json()["error"]["code"])


# -- runs --------------------------------------------------------------------------------------


async def test_create_run_is_idempotent_and_refuses_other_settings(api: Api) -> None:
    created = await api.create_run(partitions=4)
    assert (created.status_code, created.json()) == (201, {"run": RUN, "partitions": 4})
    again = await api.create_run(partitions=4)
    assert (again.status_code, again.json()) == (200, {"run": RUN, "partitions": 4})
    other = await api.create_run(partitions=8)
    assert (other.status_code, code(other)) == (409, "run_exists")


@pytest.mark.parametrize(
    "body",
    [
        {"run": "bad name"},
        {"run": "x:y"},
        {"run": ""},
        {"run": 7},
        {"run": "ok", "partitions": "4"},
        {"run": "ok", "partitions": 0},
        {"run": "ok", "surprise": True},
        {},
    ],
)
async def test_create_run_refuses_bad_requests(api: Api, body: dict[str, Any]) -> None:
    response = await api.call("POST", "/v1/runs", "trainer", 400, json=body)
    assert code(response) == "invalid_request"
    assert (await api.call("GET", "/v1/runs", "analyst", 200)).json()["runs"] == []


@pytest.mark.parametrize(
    "raw", [b'{"run": ', b"\xff\xfe{}", b'{"run": "ok", "partitions": NaN}', b"[" * 5000]
)
async def test_unparsable_request_bodies_are_invalid_requests(api: Api, raw: bytes) -> None:
    response = await api.call(
        "POST",
        "/v1/runs",
        "trainer",
        400,
        content=raw,
        headers={"Content-Type": "application/json"},
    )
    assert code(response) == "invalid_request"
    assert (await api.call("GET", "/v1/runs", "analyst", 200)).json()["runs"] == []


async def test_list_and_get_runs(api: Api) -> None:
    await api.seed(["a"])
    await api.create_run("other", 2)
    page = (await api.call("GET", "/v1/runs?limit=1", "analyst", 200)).json()
    assert [r["run"] for r in page["runs"]] == ["other"]
    assert page["next_after"] == "other"
    rest = (await api.call("GET", "/v1/runs?after=other", "analyst", 200)).json()
    assert [r["run"] for r in rest["runs"]] == [RUN]
    one = (await api.call("GET", R, "analyst", 200)).json()
    assert one["controller_epoch"] == 1
    assert one["counts"]["participants"] == 1
    assert one["counts"]["live_episodes"] == 1
    missing = await api.call("GET", "/v1/runs/nope", "analyst", 404)
    assert code(missing) == "unknown_run"


# -- participants and controller ---------------------------------------------------------------


async def test_register_participants_and_list_them(api: Api) -> None:
    await api.create_run()
    assert await api.register("env-0", "environment") == 1
    assert await api.register("env-0", "environment") == 2
    assert await api.register("pol-0", "policy") == 1
    listed = (await api.call("GET", f"{R}/participants", "analyst", 200)).json()["participants"]
    assert {(p["id"], p["kind"], p["epoch"]) for p in listed} == {
        ("env-0", "environment", 2),
        ("pol-0", "policy", 1),
    }
    other_kind = await api.call(
        "POST", f"{R}/participants", "participant", 400, json={"id": "env-0", "kind": "policy"}
    )
    assert code(other_kind) == "invalid_request"
    bad = await api.call(
        "POST", f"{R}/participants", "participant", 400, json={"id": "x", "kind": "robot"}
    )
    assert code(bad) == "invalid_request"
    unknown = await api.call(
        "POST", "/v1/runs/nope/participants", "participant", 404, json={"id": "x", "kind": "agent"}
    )
    assert code(unknown) == "unknown_run"


async def test_controller_takeover_and_compare_and_set(api: Api) -> None:
    await api.create_run()
    assert await api.take_over() == 1
    assert await api.take_over() == 2
    ok = await api.call("POST", f"{R}/controller", "trainer", 200, json={"expected_epoch": 2})
    assert ok.json() == {"controller_epoch": 3}
    stale = await api.call("POST", f"{R}/controller", "trainer", 409, json={"expected_epoch": 2})
    assert code(stale) == "stale_controller"
    assert (await api.call("GET", R, "analyst", 200)).json()["controller_epoch"] == 3
    unknown = await api.call("POST", "/v1/runs/nope/controller", "trainer", 404)
    assert code(unknown) == "unknown_run"


# -- checkpoints -------------------------------------------------------------------------------


async def test_checkpoint_commits_with_counts_offsets_and_timings(api: Api) -> None:
    await api.seed(["a", "b"])
    await api.append(f.finished("b"))
    result = await api.checkpoint()
    assert result["status"] == "committed"
    assert result["counts"] == {"continue": 1, "restart": 0, "finished": 1}
    assert len(result["offsets"]) == 4
    assert set(result["offsets"][0]) == {"partition", "marker", "replay_from"}
    assert "total" in result["timings_ms"]
    assert result["staging_keys"] == []
    listed = (await api.call("GET", f"{R}/checkpoints", "analyst", 200)).json()["checkpoints"]
    assert [c["checkpoint_id"] for c in listed] == [result["checkpoint_id"]]
    latest = (await api.call("GET", f"{R}/checkpoints/latest", "analyst", 200)).json()
    assert latest["checkpoint_id"] == result["checkpoint_id"]
    by_id = await api.call("GET", f"{R}/checkpoints/{result['checkpoint_id']}", "analyst", 200)
    assert by_id.json()["counts"] == result["counts"]


async def test_checkpoint_errors_change_nothing(api: Api) -> None:
    await api.create_run()
    no_controller = await api.checkpoint(409, controller_epoch=0)
    assert no_controller["error"]["code"] == "stale_controller"
    await api.take_over()
    await api.take_over()
    stale = await api.checkpoint(409, controller_epoch=1)
    assert stale["error"]["code"] == "stale_controller"
    assert (await api.call("GET", f"{R}/checkpoints", "analyst", 200)).json()["checkpoints"] == []
    assert code(await api.call("GET", f"{R}/checkpoints/latest", "analyst", 404)) == (
        "unknown_checkpoint"
    )
    assert code(await api.call("GET", f"{R}/checkpoints/9", "analyst", 404)) == (
        "unknown_checkpoint"
    )
    assert code(await api.call("GET", f"{R}/checkpoints/x", "analyst", 400)) == "invalid_request"
    unknown = await api.call(
        "POST", "/v1/runs/nope/checkpoints", "trainer", 404, json={"controller_epoch": 1}
    )
    assert code(unknown) == "unknown_run"
    nan = await api.call(
        "POST",
        f"{R}/checkpoints",
        "trainer",
        400,
        content=b'{"controller_epoch": 2, "deadline_s": NaN}',
        headers={"Content-Type": "application/json"},
    )
    assert code(nan) == "invalid_request"
    assert await api.log_ends() == [0, 0, 0, 0]


async def test_a_pending_checkpoint_is_202_then_commits(api: Api) -> None:
    await api.seed(["a"])
    await api.append(f.step_started("a", "verify", "wait"))
    pending = await api.checkpoint(202, wait=False, deadline_s=30)
    assert pending["status"] == "pending"
    busy = await api.checkpoint(409)
    assert busy["error"]["code"] == "checkpoint_in_progress"
    manifest = await api.call(
        "GET", f"{R}/checkpoints/{pending['checkpoint_id']}/manifest", "trainer", 404
    )
    assert manifest.json()["error"]["details"]["status"] == "pending"
    await api.append(f.boundary("a", "verify"))
    for _ in range(200):
        got = await api.call("GET", f"{R}/checkpoints/{pending['checkpoint_id']}", "analyst", 200)
        if got.json()["status"] == "committed":
            break
        await asyncio.sleep(0.02)
    assert got.json()["status"] == "committed"


async def test_manifest_as_json_and_ndjson(api: Api) -> None:
    await api.seed(["a", "b", "c"])
    await api.append(f.finished("c"))
    checkpoint_id = (await api.checkpoint())["checkpoint_id"]
    url = f"{R}/checkpoints/{checkpoint_id}/manifest"
    body = (await api.call("GET", url, "trainer", 200)).json()
    assert body["checkpoint_id"] == checkpoint_id
    assert [(e["episode"], e["action"]) for e in body["episodes"]] == [
        ("a", "continue"),
        ("b", "continue"),
        ("c", "finished"),
    ]
    entry = body["episodes"][0]
    assert set(entry) >= {"episode", "attempt", "action", "cut", "capture_key"}
    assert set(entry["cut"]) == {"partition", "offset"}
    streamed = await api.call(
        "GET", url, "trainer", 200, headers={"Accept": "application/x-ndjson"}
    )
    assert streamed.headers["content-type"].startswith("application/x-ndjson")
    assert ndjson(streamed.text) == body["episodes"]
    assert code(await api.call("GET", f"{R}/checkpoints/99/manifest", "trainer", 404)) == (
        "unknown_checkpoint"
    )


# -- restores ----------------------------------------------------------------------------------


async def test_restore_and_its_episodes(api: Api) -> None:
    await api.seed(["a", "b", "c"])
    await api.register("res-0", "resources")  # an unregistered participant is refused
    await api.append(f.session_started("c", "s1", "restart_only"), f.boundary("c", "x"))
    checkpoint = await api.checkpoint()
    result = await api.restore(exclude=["b"])
    assert result["checkpoint_id"] == checkpoint["checkpoint_id"]
    assert result["counts"] == {"continue": 1, "restart": 1, "excluded": 1}
    restore_id = result["restore_id"]
    detail = (await api.call("GET", f"{R}/restores/{restore_id}", "trainer", 200)).json()
    assert detail["restore_id"] == restore_id
    plan = {e["episode"]: e for e in detail["episodes"]}
    assert plan["a"]["action"] == "continue"
    assert plan["a"]["capture_key"] == "a-a1"
    assert (plan["a"]["previous_attempt"], plan["a"]["attempt"]) == (0, 1)
    assert plan["b"]["action"] == "excluded"
    assert plan["c"]["action"] == "restart"
    assert plan["c"]["reason"]
    episodes = await api.call("GET", f"{R}/restores/{restore_id}/episodes", "trainer", 200)
    assert episodes.json()["episodes"] == detail["episodes"]
    restarted = await api.call(
        "GET",
        f"{R}/restores/{restore_id}/episodes?action=restart",
        "trainer",
        200,
        headers={"Accept": "application/x-ndjson"},
    )
    assert [e["episode"] for e in ndjson(restarted.text)] == ["c"]
    listed = (await api.call("GET", f"{R}/restores", "trainer", 200)).json()["restores"]
    assert [r["restore_id"] for r in listed] == [restore_id]
    assert code(await api.call("GET", f"{R}/restores/42", "trainer", 404)) == "unknown_restore"
    assert code(await api.call("GET", f"{R}/restores/42/episodes", "trainer", 404)) == (
        "unknown_restore"
    )


async def test_restore_errors_change_nothing(api: Api) -> None:
    await api.seed(["a"])
    first = await api.checkpoint()
    await api.checkpoint()
    await api.checkpoint()  # the service keeps 2 committed: the first expires
    ends = await api.log_ends()
    attempts = await api.service.catalog.current_attempts(RUN)
    expired = await api.restore(404, checkpoint_id=first["checkpoint_id"])
    assert expired["error"]["code"] == "unknown_checkpoint"
    assert expired["error"]["details"]["status"] == "expired"
    unknown = await api.restore(404, checkpoint_id=77)
    assert unknown["error"]["code"] == "unknown_checkpoint"
    excluded = await api.restore(404, exclude=["ghost"])
    assert excluded["error"]["code"] == "unknown_episode"
    bad = await api.restore(400, checkpoint_id="newest")
    assert bad["error"]["code"] == "invalid_request"
    old_epoch = api.epoch
    await api.take_over()
    stale = await api.restore(409, controller_epoch=old_epoch)
    assert stale["error"]["code"] == "stale_controller"
    assert await api.log_ends() == ends
    assert await api.service.catalog.current_attempts(RUN) == attempts
    assert (await api.call("GET", f"{R}/restores", "trainer", 200)).json()["restores"] == []


# -- projections -------------------------------------------------------------------------------


async def _restored(api: Api) -> int:
    await api.seed(["a", "b", "c"])
    await api.register("policy-0", "policy")  # an unregistered participant is refused
    await api.register("res-0", "resources")
    await api.append(
        f.session_started("a", "s1", "exported", who=f.participant("resources", "res-0")),
        f.session_state("a", "s1", {"files": ["x"], "ünï": "code"}),
        f.ledger_row("a", "c1", [1, 2, 3]),
        f.boundary("a", "invoke_agent", {"turn": 2, "nested": {"k": [1, 2.5, None]}}),
        f.session_started("c", "s9", "restart_only"),
        f.boundary("c", "invoke_agent"),
    )
    await api.checkpoint()
    return int((await api.restore())["restore_id"])


async def test_projection_of_a_restored_episode(api: Api) -> None:
    restore_id = await _restored(api)
    url = f"{R}/episodes/a/projection"
    body = (await api.call("GET", f"{url}?restore={restore_id}", "participant", 200)).json()
    assert (body["episode"], body["attempt"], body["capture_key"]) == ("a", 1, "a-a1")
    assert body["task"] == {"prompt": "task of a"}
    assert body["task_digest"] == f.task_digest({"prompt": "task of a"})
    env = body["boundaries"]["environment"]
    assert env["stage"] == "invoke_agent"
    assert env["state"] == {"turn": 2, "nested": {"k": [1, 2.5, None]}}
    session = body["sessions"]["s1"]
    assert (session["kind"], session["participant"], session["mode"]) == (
        "resources",
        "res-0",
        "exported",
    )
    assert session["state"] == {"files": ["x"], "ünï": "code"}
    assert [row["call_id"] for row in body["ledger"]] == ["c1"]
    assert body["ledger"][0]["token_ids"] == [1, 2, 3]
    assert body["generation_cut"] is None
    latest = (await api.call("GET", f"{url}?restore=latest", "participant", 200)).json()
    assert latest == body
    at_checkpoint = (await api.call("GET", f"{url}?checkpoint=1", "participant", 200)).json()
    assert at_checkpoint["attempt"] == 0
    assert at_checkpoint["boundaries"] == body["boundaries"]


async def test_projection_errors(api: Api) -> None:
    restore_id = await _restored(api)
    url = f"{R}/episodes"
    restarted = await api.call(
        "GET", f"{url}/c/projection?restore={restore_id}", "participant", 404
    )
    assert code(restarted) == "unknown_episode"
    assert restarted.json()["error"]["details"]["action"] == "restart"
    assert restarted.json()["error"]["details"]["capture_key"] == "c-a1"
    ghost = await api.call(
        "GET", f"{url}/ghost/projection?restore={restore_id}", "participant", 404
    )
    assert code(ghost) == "unknown_episode"
    assert code(await api.call("GET", f"{url}/a/projection?restore=9", "participant", 404)) == (
        "unknown_restore"
    )
    assert code(await api.call("GET", f"{url}/a/projection?checkpoint=9", "participant", 404)) == (
        "unknown_checkpoint"
    )
    for query in ("", "?restore=1&checkpoint=1", "?restore=first"):
        response = await api.call("GET", f"{url}/a/projection{query}", "participant", 400)
        assert code(response) == "invalid_request"
    other = await api.call(
        "GET", "/v1/runs/nope/episodes/a/projection?restore=latest", "admin", 404
    )
    assert code(other) == "unknown_run"


async def test_bulk_projections_filtered_by_participant(api: Api) -> None:
    restore_id = await _restored(api)
    url = f"{R}/restores/{restore_id}/projections"

    async def episodes(query: str) -> list[str]:
        response = await api.call("GET", url + query, "participant", 200)
        assert response.headers["content-type"].startswith("application/x-ndjson")
        # (in no fixed order: each as soon as it is built)
        return sorted(p["episode"] for p in ndjson(response.text))

    assert await episodes("") == ["a", "b"]  # c restarts: no projection
    assert await episodes("?kind=environment") == ["a", "b"]
    assert await episodes("?kind=resources") == ["a"]
    assert await episodes("?kind=resources&participant=res-0") == ["a"]
    assert await episodes("?participant=res-1") == []
    assert await episodes("?kind=policy") == ["a"]
    assert await episodes("?kind=agent") == []
    refused = await api.call("GET", url + "?kind=policy&participant=p", "participant", 400)
    assert code(refused) == "invalid_request"
    unknown = await api.call("GET", f"{R}/restores/99/projections", "participant", 404)
    assert code(unknown) == "unknown_restore"


async def test_large_states_are_served_byte_for_byte_as_a_replay_gives_them(api: Api) -> None:
    """A state of ``SPLICE_BYTES`` or more is written as a chunk of its own (a view of its
    record, not joined into its line): the stream is the replay's lines, byte for byte."""
    await api.seed(["a", "b"])
    await api.register("res-0", "resources")
    res = f.participant("resources", "res-0")
    await api.append(
        f.session_started("a", "s1", "exported", who=res),
        f.session_state("a", "s1", {"blob": "x" * (3 * SPLICE_BYTES), "ünï": [1, 2]}, who=res),
        f.boundary("b", "invoke_agent", {"big": "y" * SPLICE_BYTES}),
    )
    await api.checkpoint()
    restore_id = int((await api.restore())["restore_id"])
    url = f"{R}/restores/{restore_id}/projections"
    served = (await api.call("GET", url, "participant", 200)).content
    replayed = await api.service.coordinator.restore_projections(RUN, restore_id)
    lines = [ProjectionLine.of(projection).line for projection in replayed.values()]
    assert sorted(served.splitlines(keepends=True)) == sorted(lines)


async def test_a_large_piece_is_a_chunk_of_its_own_and_not_copied() -> None:
    big = memoryview(b"[" + b"1," * SPLICE_BYTES + b"1]")[1:-1]
    pieces: list[bytes | memoryview] = [b'{"a":[', big, b"]}\n", b"{}\n" * 3, b"{}\n"]

    async def produced() -> AsyncIterator[bytes | memoryview]:
        for piece in pieces:
            yield piece

    chunks = [chunk async for chunk in stream_ndjson_lines(produced()).body_iterator]
    assert b"".join(chunks) == b"".join(pieces)  # type: ignore[arg-type]
    assert [type(c) for c in chunks] == [bytes, memoryview, bytes]
    assert chunks[1] is big


# -- episodes and stats ------------------------------------------------------------------------


async def test_episodes_paged_and_streamed(api: Api) -> None:
    await api.seed(["a", "b", "c"])
    await api.append(f.finished("c"))
    page = (await api.call("GET", f"{R}/episodes?limit=2", "analyst", 200)).json()
    assert [e["episode"] for e in page["episodes"]] == ["a", "b"]
    assert page["next_after"] == "b"
    assert page["episodes"][0]["live"] is True
    rest = (await api.call("GET", f"{R}/episodes?after=b", "analyst", 200)).json()
    assert [(e["episode"], e["status"]) for e in rest["episodes"]] == [("c", "finished")]
    streamed = await api.call(
        "GET",
        f"{R}/episodes?status=running",
        "analyst",
        200,
        headers={"Accept": "application/x-ndjson"},
    )
    assert [e["episode"] for e in ndjson(streamed.text)] == ["a", "b"]
    await api.checkpoint()
    await api.restore(exclude=["b"])
    restored = (await api.call("GET", f"{R}/episodes", "analyst", 200)).json()["episodes"]
    assert [(e["episode"], e["status"], e["capture_key"]) for e in restored] == [
        ("a", "running", "a-a1"),
        ("b", "excluded", "b-a1"),
        ("c", "finished", "c"),  # recorded by the checkpoint that reported it
    ]
    assert code(await api.call("GET", "/v1/runs/nope/episodes", "analyst", 404)) == "unknown_run"
    bad = await api.call("GET", f"{R}/episodes?status=zombie", "analyst", 400)
    assert code(bad) == "invalid_request"


async def test_stats(api: Api) -> None:
    await api.seed(["a", "b"])
    await api.checkpoint()
    await api.restore()
    stats = (await api.call("GET", f"{R}/stats", "analyst", 200)).json()
    assert stats["participants"] == 1
    assert stats["events"]["log_records"] >= 4
    assert stats["checkpoints"]["counts"] == {"committed": 1}
    assert stats["checkpoints"]["duration_ms_last"] is not None
    assert stats["restores"]["count"] == 1
    assert "total" in stats["restores"]["last_timings_ms"]
    assert stats["episodes"]["live"] == 2
    assert code(await api.call("GET", "/v1/runs/nope/stats", "analyst", 404)) == "unknown_run"


# -- the HTTP layer ----------------------------------------------------------------------------


async def test_unknown_routes_and_methods_are_json_errors(api: Api) -> None:
    missing = await api.client.get("/v2/nothing", headers=bearer("admin"))
    assert (missing.status_code, code(missing)) == (404, "not_found")
    wrong = await api.client.delete("/v1/runs", headers=bearer("admin"))
    assert (wrong.status_code, code(wrong)) == (405, "method_not_allowed")


async def test_large_bodies_on_other_routes_are_refused(api: Api) -> None:
    body = b'{"run": "x", "pad": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    response = await api.call(
        "POST",
        "/v1/runs",
        "trainer",
        413,
        content=body,
        headers={"Content-Type": "application/json"},
    )
    assert code(response) == "payload_too_large"
