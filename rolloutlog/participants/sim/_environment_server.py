"""The simulated environment server: single-turn agent episodes through the stages of docs/design.md
§7, a boundary after each, ``episode.finished`` before the reply."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from rolloutlog.participants._environment import STAGES, Environment, EnvironmentEpisode
from rolloutlog.participants._participant import RolloutContext
from rolloutlog.participants.sim._runtime import ServerSettings, SimServer

__all__ = ["environment_server"]


def environment_server(settings: ServerSettings) -> SimServer:
    """``POST /run`` ``{"task", "capture_key", "action"?, "restore_id"?}`` → ``{"episode",
    "capture_key", "reward", "result", "resumed_stage", "stages"}``.

    ``action`` ``continue`` (with a restore id) resumes the attempt from its projection (task
    digest checked) at its next stage; anything else starts the episode at ``seed`` under
    ``capture_key``. Stages: ``seed`` (resources ``/seed_session``; its verify header is kept in
    the boundary), ``invoke_agent`` (agent ``/run``), ``close_agent`` (wait; agent ``/close``),
    ``verify`` (mode from the header; resources ``/verify``), ``return`` (resources
    ``/close_session``, ``episode.finished``, reply).

    Hold points: ``before:<stage>``, ``in:<stage>`` (after its ``step.started``),
    ``before_finish``, ``after_finish`` (finished durable, reply not sent). ``POST
    /sim/started`` ``{"keys"}`` → ``{"missing"}``: the capture keys whose ``episode.started``
    (or resume) is not yet durable here. ``/sim/stats``: ``runs`` (capture key, resumed stage,
    stages run, reward).
    """
    server = SimServer(settings, lambda t, run: Environment(t, run, settings.participant_id))
    assert settings.agent_url is not None
    agent_url = settings.agent_url
    started: set[tuple[str, str]] = set()  # (run, capture key)
    runs: list[dict[str, Any]] = []
    server.stats = lambda: {"runs": runs, "started": len(started)}
    app = server.app

    @app.post("/sim/started")
    async def missing(body: dict[str, Any]) -> dict[str, Any]:
        run = str(body.get("run") or settings.run)
        return {"missing": [key for key in body.get("keys", []) if (run, key) not in started]}

    @app.post("/run")
    async def run(request: Request) -> dict[str, Any]:
        body = await request.json()
        task = body["task"]
        context = RolloutContext.of(str(body.get("capture_key") or task["id"]))
        key = context.capture_key
        restore_id = server.restore_id(None, body)
        run_name = server.run_of(None, body)
        env = await server.participant_in(run_name)
        assert isinstance(env, Environment)
        resources_url = settings.resources_urls[task["resources"]]
        state: dict[str, Any] = {}
        stage = "seed"
        resumed: str | None = None
        episode: EnvironmentEpisode | None = None
        if body.get("action") == "continue" and context.attempt > 0:
            projection = await server.projection(context.episode, restore_id, run_name)
            if projection is not None and projection.get("capture_key") == key:
                resumed_at = env.resume(projection, task)
                episode, stage = resumed_at.episode, resumed_at.stage
                state = dict(resumed_at.state or {})
                resumed = stage
                episode.set_verify_mode(state.get("verify"))
        if episode is None:
            episode = await env.start_episode(context, task)
        started.add((run_name, key))
        record: dict[str, Any] = {
            "run": run_name,
            "capture_key": key,
            "resumed_stage": resumed,
            "stages": [],
        }
        runs.append(record)
        holds = server.holds
        for current in STAGES[STAGES.index(stage) :]:
            await holds.park(f"before:{current}", key)
            await episode.step_started(current)
            await holds.park(f"in:{current}", key)
            record["stages"].append(current)
            if current == "seed":
                seeded = await server.post(
                    resources_url, "/seed_session", context, {}, None, run_name
                )
                state["session"] = seeded.json().get("session_id")
                state["verify"] = episode.set_verify_mode(seeded.headers)
                state["restart"] = seeded.headers.get("x-ng-checkpoint-restart") == "1"
                await episode.boundary(current, state)
            elif current == "invoke_agent":
                reply = await server.post(
                    agent_url, "/run", context, {"task": task}, restore_id, run_name
                )
                state["response"] = reply.json()
                await episode.boundary(current, state)
            elif current == "close_agent":
                await server.post(agent_url, "/close", context, {}, restore_id, run_name)
                state["agent_closed"] = True
                await episode.boundary(current, state)
            elif current == "verify":
                verdict = await server.post(
                    resources_url,
                    "/verify",
                    context,
                    {"task": task, "response": state["response"]},
                    restore_id,
                    run_name,
                )
                state["verdict"] = verdict.json()
                await episode.boundary(current, state)
            else:
                await server.post(
                    resources_url, "/close_session", context, {}, restore_id, run_name
                )
                await holds.park("before_finish", key)
                reward = float(state["verdict"]["reward"])
                result = {"verdict": state["verdict"], "answer": state["response"]["answer"]}
                await episode.finish(reward, result)
                await holds.park("after_finish", key)
                record["reward"] = reward
                return {
                    "episode": context.episode,
                    "capture_key": key,
                    "reward": reward,
                    "result": result,
                    "resumed_stage": resumed,
                    "stages": record["stages"],
                    "response": state["response"],
                }
        raise AssertionError("unreachable: the return stage replies")

    return server
