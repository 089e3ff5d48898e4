"""A NeMo Gym resources server's sessions recorded through ASGI middleware only, with the
rollout context from headers or from the cookies a stock ``SimpleAgent`` forwards."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from rolloutlog.integrations.nemo_gym import (
    CAPTURE_KEY_COOKIE,
    GymContextMiddleware,
    GymSettings,
    attach_resources,
    rollout_cookies,
    rollout_headers,
)
from rolloutlog.integrations.nemo_gym.examples.session_counter import CounterState
from rolloutlog.participants import Environment, RolloutContext
from tests.integrations.nemo_gym._apps import SESSION_COOKIE, resources_app
from tests.participants.conftest import RUN, World


def settings(mode: str, **options: Any) -> GymSettings:
    return GymSettings(
        url="http://unused.test",
        run=RUN,
        participant_id=f"counter-{mode}",
        kind="resources_servers",
        options={"mode": mode, **options},
    )


async def events(world: World, episode: str) -> list[tuple[str, str, Any]]:
    history = await world.trainer.episode_history(RUN, episode)
    return [(e["type"], e["participant"], e.get("data")) for e in history["events"]]


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://res.test")


async def agent_chain(
    http: httpx.AsyncClient, key: str, increments: int, restore_id: int | None = None
) -> httpx.Response:
    """What SimpleAgent does: /run's cookies to /seed_session, then each reply's cookies only."""
    cookies = rollout_cookies(RolloutContext.of(key), restore_id)
    reply = await http.post("/seed_session", headers=_cookie(cookies))
    for _ in range(increments):
        reply = await http.post("/increment_counter", headers=_cookie(dict(reply.cookies)))
    return await http.post("/verify", headers=_cookie(dict(reply.cookies)))


def _cookie(cookies: dict[str, str]) -> dict[str, str]:
    return {"cookie": "; ".join(f"{k}={v}" for k, v in cookies.items())}


async def test_restart_only_sessions_ride_the_agents_cookie_chain(world: World) -> None:
    app, counters = resources_app()
    served = attach_resources(None, app, settings("restart_only"), transport=world.transport)
    async with client(served) as http:
        seeded = await http.post("/seed_session", headers=_cookie({CAPTURE_KEY_COOKIE: "t0-r0"}))
        assert seeded.headers["x-ng-checkpoint-verify"] == "wait"
        assert seeded.headers["x-ng-checkpoint-restart"] == "1"
        assert seeded.cookies[CAPTURE_KEY_COOKIE] == "t0-r0"  # echoed: the agent passes it on
        assert SESSION_COOKIE in seeded.cookies  # NeMo Gym's own session cookie is untouched
        verified = await agent_chain(http, "t1-r0", 3)
        assert verified.json() == {"reward": 3.0}
        assert verified.cookies[CAPTURE_KEY_COOKIE] == "t1-r0"
    assert sorted(counters.values()) == [0, 3]
    recorded = await events(world, "t1-r0")
    assert recorded == [
        (
            "session.started",
            "counter-restart_only",
            {"session_id": "counter-restart_only:t1-r0", "mode": "restart_only", "verify": "wait"},
        )
    ]  # verify ends no session: a verify that replays needs it


async def test_a_restart_only_session_open_at_the_cut_restarts_its_episode(world: World) -> None:
    app, _ = resources_app()
    served = attach_resources(None, app, settings("restart_only"), transport=world.transport)
    stateless_app, _ = resources_app()
    stateless = attach_resources(
        None, stateless_app, settings("stateless", verify="replay"), transport=world.transport
    )
    env = Environment(world.transport, RUN, "collector")
    await env.register()
    for key, server in (("r-only", served), ("r-less", stateless), ("r-tail", served)):
        episode = await env.start_episode(key, {"row": key})
        await episode.step_started("invoke_agent")
        async with client(server) as http:
            seeded = await http.post("/seed_session", headers=rollout_headers(RolloutContext(key)))
            assert seeded.status_code == 200
        if key == "r-less":
            assert seeded.headers["x-ng-checkpoint-verify"] == "replay"
            assert "x-ng-checkpoint-restart" not in seeded.headers
        if key != "r-tail":  # a boundary after the seed (an agent's, say) commits the session
            await episode.boundary("invoke_agent", {"seeded": True})
    await world.trainer.checkpoint(RUN)
    restore = await world.trainer.restore(RUN)
    plan = {e.episode: e async for e in world.trainer.restore_episodes(RUN, restore.restore_id)}
    assert plan["r-only"].action == "restart"
    assert "restart-only session" in (plan["r-only"].reason or "")
    assert plan["r-less"].action == "continue"
    # a session opened by the step in flight is in the tail: the step replays, and seeds anew
    assert plan["r-tail"].action == "continue"


async def test_an_exported_server_records_its_state_and_a_replacement_gets_it_back(
    world: World,
) -> None:
    app, counters = resources_app()
    global FACTORY
    FACTORY = lambda server: CounterState(SimpleNamespace(session_id_to_counter=counters))  # noqa: E731
    served = attach_resources(
        None,
        app,
        settings("exported", state=f"{__name__}:FACTORY"),
        transport=world.transport,
        restores=world.restores,
    )
    env = Environment(world.transport, RUN, "collector")
    await env.register()
    episode = await env.start_episode("t2-r0", {"row": 2})
    async with client(served) as http:
        verified = await agent_chain(http, "t2-r0", 2)
        await episode.boundary("invoke_agent", {"reply": None})
        # past the boundary: in the tail of the cut, so the restore leaves it out
        await http.post("/increment_counter", headers=_cookie(dict(verified.cookies)))
    (first,) = counters
    assert counters == {first: 3}
    kinds = [kind for kind, _, _ in await events(world, "t2-r0")]
    assert kinds.count("session.state") == 5  # seed, two increments, verify, one more
    await world.trainer.checkpoint(RUN)
    restore = await world.trainer.restore(RUN)
    projection = await world.restores.fetch(RUN, "t2-r0", restore.restore_id)
    recorded = projection["sessions"]["counter-exported:t2-r0"]["state"]
    assert recorded == {"gym_session": first, "state": 2}

    # The replacement attempt seeds again (a stock SimpleAgent's /run does): a new NeMo Gym
    # session, which gets the restored count before the server sees the request; the session
    # it supersedes (this server lived through the restore, with the tail's count) is retired.
    async with client(served) as http:
        verified = await agent_chain(http, "t2-r0-a1", 1, restore.restore_id)
    assert verified.json() == {"reward": 3.0}
    (second,) = counters
    assert second != first and counters == {second: 3}


FACTORY: Any = None


async def test_requests_without_a_context_pass_or_are_refused(world: World) -> None:
    app, _ = resources_app()
    lenient = attach_resources(None, app, settings("stateless"), transport=world.transport)
    strict_app, _ = resources_app()
    strict = attach_resources(
        None, strict_app, settings("stateless", rollout_id_required=True), transport=world.transport
    )
    async with client(lenient) as http:
        assert (await http.post("/seed_session")).status_code == 200
    async with client(strict) as http:
        refused = await http.post("/seed_session")
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "invalid_request"
        assert (await http.get("/")).json() == {"status": "ok"}  # liveness is no rollout work
        assert (await http.post("/aggregate_metrics")).status_code == 200


async def test_a_header_wins_over_a_cookie_and_cookies_become_headers() -> None:
    seen: list[dict[str, str]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append({k.decode(): v.decode() for k, v in scope["headers"] if b"rolloutlog" in k})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async with client(GymContextMiddleware(app)) as http:
        both = {
            **rollout_headers(RolloutContext("h1", 2), 7),
            **_cookie({CAPTURE_KEY_COOKIE: "c1"}),
        }
        reply = await http.post("/x", headers=both)
        http.cookies.clear()  # only what each request says
        only_cookies = await http.post(
            "/x", headers=_cookie(rollout_cookies(RolloutContext("c2"), 9))
        )
        http.cookies.clear()
        bare = await http.post("/x")
    assert seen[0]["x-rolloutlog-capture-key"] == "h1-a2"
    assert reply.cookies[CAPTURE_KEY_COOKIE] == "h1-a2"  # what is echoed is what was used
    assert seen[1] == {"x-rolloutlog-capture-key": "c2", "x-rolloutlog-restore-id": "9"}
    assert only_cookies.cookies["rolloutlog-restore-id"] == "9"
    assert seen[2] == {} and "set-cookie" not in bare.headers


@pytest.mark.parametrize("mode", ["sandbox", "exported"])
def test_unknown_modes_and_an_exported_server_without_a_hook_are_refused(mode: str) -> None:
    app, _ = resources_app()
    with pytest.raises(ValueError, match="mode"):
        attach_resources(None, app, settings(mode))
