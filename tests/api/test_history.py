"""Analysts' reads: restores and manifests with an analyst token, an episode's history across
attempts, one event in full, projector lag, and the OpenAPI document's tags and roles."""

from __future__ import annotations

from tests import factories as f
from tests.api.conftest import Api

ANALYST_TAGS = {"runs", "events", "checkpoints", "restores", "analysts", "operations"}


async def _checkpoint_and_restore(api: Api) -> None:
    await api.seed(["ep-c", "ep-d", "ep-e"])
    await api.register("res-0", "resources")
    # ep-c: a restart_only session open at its boundary; ep-d continues; ep-e is excluded.
    await api.append(f.session_started("ep-c", "sandbox"), f.boundary("ep-c", "act", {"turn": 2}))
    await api.checkpoint()
    await api.restore(exclude=["ep-e"])


async def test_analysts_read_restores_plans_and_manifests_but_write_nothing(api: Api) -> None:
    await _checkpoint_and_restore(api)
    run = f"/v1/runs/{api.run}"
    await api.call("GET", f"{run}/restores", "analyst", 200)
    await api.call("GET", f"{run}/restores/1", "analyst", 200)
    plan = (await api.call("GET", f"{run}/restores/1/episodes", "analyst", 200)).json()
    assert {e["episode"]: e["action"] for e in plan["episodes"]} == {
        "ep-c": "restart",
        "ep-d": "continue",
        "ep-e": "excluded",
    }
    await api.call("GET", f"{run}/checkpoints/1/manifest", "analyst", 200)
    await api.call(
        "POST", f"{run}/restores", "analyst", 403, json={"controller_epoch": 1, "checkpoint_id": 1}
    )


async def test_an_episodes_history_across_attempts(api: Api) -> None:
    await _checkpoint_and_restore(api)
    run = f"/v1/runs/{api.run}"
    restarted = (await api.call("GET", f"{run}/episodes/ep-c", "analyst", 200)).json()
    assert restarted["current_attempt"] == 1 and restarted["capture_key"] == "ep-c-a1"
    assert [a["attempt"] for a in restarted["attempts"]] == [0, 1]
    assert restarted["attempts"][0]["began_with"] == "episode.started"
    assert restarted["attempts"][1]["began_with"] == "attempt.started"
    assert restarted["attempts"][1]["action"] == "restart"
    (entry,) = restarted["restores"]
    reason = "restart-only session sandbox of resources server res-0 open at the cut"
    assert entry["reason"] == reason
    assert reason in entry["explanation"]
    (manifest,) = restarted["checkpoints"]
    assert manifest["checkpoint_id"] == 1 and manifest["action"] == "restart"
    timeline = restarted["events"]
    assert [e["type"] for e in timeline[:2]] == ["episode.started", "step.boundary"]
    assert timeline[-1]["type"] == "attempt.started" and timeline[-1]["attempt"] == 1
    assert all("task" not in e["data"] and "state" not in e["data"] for e in timeline)
    assert timeline[0]["payload_bytes"] > 0
    assert restarted["event_count"] == len(timeline)

    continued = (await api.call("GET", f"{run}/episodes/ep-d", "analyst", 200)).json()
    resumed = continued["attempts"][1]["resumed_from"]
    assert resumed["stage"] == "seed" and resumed["boundary_offset"] is not None
    assert "continued from checkpoint 1's cut" in continued["restores"][0]["explanation"]
    excluded = (await api.call("GET", f"{run}/episodes/ep-e", "analyst", 200)).json()
    assert "excluded by the trainer" in excluded["restores"][0]["explanation"]

    page = (await api.call("GET", f"{run}/episodes/ep-c?limit=1", "analyst", 200)).json()
    assert len(page["events"]) == 1 and page["next_after"] == timeline[0]["offset"]
    rest = await api.call("GET", f"{run}/episodes/ep-c?after={page['next_after']}", "analyst", 200)
    assert rest.json()["events"] == timeline[1:]

    first = timeline[0]["offset"]
    event = (await api.call("GET", f"{run}/episodes/ep-c/events/{first}", "analyst", 200)).json()
    assert event["event"]["data"]["task"] == {"prompt": "task of ep-c"}
    beyond = await api.call("GET", f"{run}/episodes/ep-c/events/1000000", "analyst", 404)
    assert beyond.json()["error"]["code"] == "unknown_episode"
    unknown = await api.call("GET", f"{run}/episodes/nobody", "analyst", 404)
    assert unknown.json()["error"]["code"] == "unknown_episode"


async def test_projector_lag_per_partition(api: Api) -> None:
    await api.seed(["a", "b"])
    lag = (await api.call("GET", f"/v1/runs/{api.run}/projector", "analyst", 200)).json()
    ends = await api.log_ends()
    assert [p["end_offset"] for p in lag["partitions"]] == ends
    assert lag["log_records"] == sum(ends)
    assert lag["lag"] == sum(p["lag"] for p in lag["partitions"]) >= 0


async def test_openapi_tags_every_route_and_states_its_role(api: Api) -> None:
    schema = (await api.client.get("/openapi.json")).json()
    assert {t["name"] for t in schema["tags"]} == ANALYST_TAGS
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert len(operation["tags"]) == 1 and operation["tags"][0] in ANALYST_TAGS, path
            assert operation["description"].startswith("**Role:**"), (method, path)
    history = schema["paths"]["/v1/runs/{run}/episodes/{episode}"]["get"]
    assert history["tags"] == ["analysts"]
    assert history["description"].startswith("**Role:** `analyst` (or trainer, admin).")
    docs = await api.client.get("/docs")
    assert docs.status_code == 200 and "/docs/assets/swagger-ui-bundle.js" in docs.text
    assert "cdn" not in docs.text.lower()
    bundle = await api.client.get("/docs/assets/swagger-ui-bundle.js")
    assert bundle.status_code == 200
    shell = (await api.client.get("/ui")).text
    scripts = ["/ui/static/base.js", "/ui/static/charts.js", "/ui/static/app.js"]
    assert [line for line in shell.splitlines() if "<script" in line] == [
        f'<script src="{script}" defer></script>' for script in scripts
    ]  # in this order: each script uses what the ones before it declare
    for script in scripts:
        assert (await api.client.get(script)).status_code == 200
