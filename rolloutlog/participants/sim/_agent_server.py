"""The simulated agent: one session per episode, a model call and a tool round per turn, with
lazy boundary snapshots before each model call and after each tool round."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from rolloutlog.participants._sessions import Agent, AgentSession
from rolloutlog.participants.sim._model import answer_of
from rolloutlog.participants.sim._runtime import ServerSettings, SimServer, request_context

__all__ = ["agent_server", "agent_session_id"]


#: The JSON schema a constrained model call asks its reply to follow.
_ANSWER_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": {"type": "object"}},
}


def agent_session_id(episode: str) -> str:
    return f"agent:{episode}"


def agent_server(settings: ServerSettings) -> SimServer:
    """``POST /run`` ``{"task"}`` under a rollout context → ``{"answer", "turns", "calls",
    "rounds", "resumed"}``: ``rounds`` tool rounds on the task's resources server, each after a
    model call, and a final model call. A replacement attempt (a restore id in the body or the
    ``x-sim-restore-id`` header) resumes its session from the last snapshot in its projection.
    ``POST /close`` ends the session. Hold points: ``before_model_call`` (snapshot durable, call
    not sent), ``after_tool_round`` (snapshot durable). ``/sim/stats``: ``runs`` (capture key,
    resumed round or None, snapshots written, snapshots skipped).
    """
    server = SimServer(settings, lambda t, run: Agent(t, run, settings.participant_id))
    assert settings.policy_urls, "the agent needs --policy-url"
    policy_urls = settings.policy_urls
    runs: list[dict[str, Any]] = []
    server.stats = lambda: {"runs": runs}
    app = server.app

    @app.post("/run")
    async def run(request: Request) -> dict[str, Any]:
        body = await request.json()
        context = request_context(request)
        key = context.capture_key
        task = body["task"]
        restore_id = server.restore_id(request, body)
        run_name = server.run_of(request)
        agent = await server.participant_in(run_name)
        assert isinstance(agent, Agent)
        sid = agent_session_id(context.episode)
        state: dict[str, Any] = {"round": 0, "turns": [], "calls": [], "tools": []}
        session: AgentSession | None = None
        resumed: int | None = None
        if context.attempt > 0:
            projection = await server.projection(context.episode, restore_id, run_name)
            if projection is not None and projection.get("capture_key") == key:
                session, restored, _ = agent.resume(projection, sid)
                if restored is not None:
                    state = restored
                    resumed = int(state["round"])
        if session is None:
            session = await agent.open_session(context, sid)
        record = {
            "run": run_name,
            "capture_key": key,
            "resumed": resumed,
            "snapshots": 0,
            "skipped": 0,
        }
        runs.append(record)
        resources_url = settings.resources_urls[task["resources"]]
        rounds = int(task["rounds"])
        constrained = set(task.get("constrained", ()))
        while True:
            index = len(state["turns"])
            await session.before_model_call(state)
            await server.holds.park("before_model_call", key, call_index=index)
            reply = (
                await server.post(
                    policy_urls[index % len(policy_urls)],
                    "/generate",
                    context,
                    {
                        "turns": state["turns"],
                        "call_index": index,
                        "tokens": task["tokens"],
                        # a structured-output request: the policy classifies it as constrained
                        **({"response_format": _ANSWER_FORMAT} if index in constrained else {}),
                        "token_rate": task.get("token_rate"),
                    },
                    restore_id,
                    run_name,
                )
            ).json()
            state = {
                **state,
                "turns": [*state["turns"], reply["text"]],
                "calls": [*state["calls"], reply["call_id"]],
            }
            if state["round"] >= rounds:
                break
            tool = (
                await server.post(
                    resources_url,
                    "/tool",
                    context,
                    {"round": state["round"]},
                    restore_id,
                    run_name,
                )
            ).json()
            state = {**state, "round": state["round"] + 1, "tools": [*state["tools"], tool]}
            await session.after_tool_round(state)
            await server.holds.park("after_tool_round", key, round=state["round"])
        record["snapshots"], record["skipped"] = session.snapshots, session.skipped
        return {
            "answer": answer_of(state["turns"]),
            "turns": state["turns"],
            "calls": state["calls"],
            "rounds": state["round"],
            "resumed": resumed,
        }

    @app.post("/close")
    async def close(request: Request) -> dict[str, Any]:
        context = request_context(request)
        agent = await server.participant_in(server.run_of(request))
        assert isinstance(agent, Agent)
        session = AgentSession(agent, context, agent_session_id(context.episode))
        await session.close()
        return {"closed": session.session_id}

    return server
