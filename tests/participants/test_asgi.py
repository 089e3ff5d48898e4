"""The rollout context of a request, read from its headers (middleware and FastAPI dependency)."""

from __future__ import annotations

from typing import Annotated

import httpx
from fastapi import Depends, FastAPI

from rolloutlog.participants import (
    CAPTURE_KEY_HEADER,
    STEP_HEADER,
    Environment,
    Resources,
    ResourcesMiddleware,
    RolloutContext,
    RolloutContextMiddleware,
    context_headers,
    current_context,
    rollout_context,
)
from tests.participants.conftest import RUN, World


def make_app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(RolloutContextMiddleware)

    @app.get("/middleware")
    async def from_middleware() -> dict[str, object]:
        context = current_context()
        return {"context": None if context is None else [context.capture_key, context.step]}

    @app.get("/dependency")
    async def from_dependency(
        context: Annotated[RolloutContext | None, Depends(rollout_context)],
    ) -> dict[str, object]:
        return {"context": None if context is None else [context.episode, context.attempt]}

    return app


async def test_headers_carry_the_rollout_context() -> None:
    transport = httpx.ASGITransport(app=make_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://env.test") as client:
        headers = context_headers(RolloutContext("r17", 2, step=4))
        assert headers == {CAPTURE_KEY_HEADER: "r17-a2", STEP_HEADER: "4"}
        assert (await client.get("/middleware", headers=headers)).json() == {
            "context": ["r17-a2", 4]
        }
        assert (await client.get("/dependency", headers=headers)).json() == {"context": ["r17", 2]}
        assert (await client.get("/middleware")).json() == {"context": None}
        assert current_context() is None
        bad = await client.get("/middleware", headers={CAPTURE_KEY_HEADER: "r17-a0"})
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_request"


async def test_a_resources_server_records_its_sessions_from_its_routes(world: World) -> None:
    counters: dict[str, int] = {}
    resources = Resources(world.transport, RUN, "res-0", mode="exported", verify="wait")
    env = Environment(world.transport, RUN, "env-0")
    await resources.register()
    await env.register()

    async def state(context: RolloutContext, session_id: str) -> dict[str, int]:
        return {"counter": counters.get(context.episode, 0)}

    app = FastAPI()

    @app.post("/seed_session")
    async def seed() -> dict[str, str]:
        return {"ok": "seeded"}

    @app.post("/add")
    async def add() -> dict[str, int]:
        context = current_context()
        if context is None:
            return {"counter": -1}
        counters[context.episode] = counters.get(context.episode, 0) + 1
        return {"counter": counters[context.episode]}

    @app.post("/close_session")
    async def close() -> dict[str, str]:
        return {"ok": "closed"}

    server = ResourcesMiddleware(app, resources, state=state)
    transport = httpx.ASGITransport(app=server)
    async with httpx.AsyncClient(transport=transport, base_url="http://res.test") as client:
        episode = await env.start_episode("e1", {"p": 1})
        headers = context_headers(RolloutContext("e1", 0, step=1))
        seeded = await client.post("/seed_session", headers=headers)
        assert seeded.headers["x-ng-checkpoint-verify"] == "wait"
        for _ in range(3):
            await client.post("/add", headers=headers)
        assert (await client.post("/add")).status_code == 200  # no rollout context: untouched
        await episode.boundary("seed", {"resources": "res-0:e1"})
        await world.trainer.checkpoint(RUN)
        restore = await world.trainer.restore(RUN)
        projection = await world.restores.fetch(RUN, "e1", restore.restore_id)
        assert resources.restored_state(projection, "res-0:e1") == {"counter": 3}
        assert projection["sessions"]["res-0:e1"]["verify"] == "wait"
        replacement = context_headers(RolloutContext("e1", 1))
        assert (await client.post("/close_session", headers=replacement)).status_code == 200


async def test_rollout_id_required_refuses_requests_without_a_context(world: World) -> None:
    app = FastAPI()

    @app.post("/generate")
    async def generate() -> dict[str, object]:
        context = current_context()
        return {"context": None if context is None else context.capture_key}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"ok": "yes"}

    strict = RolloutContextMiddleware(app, rollout_id_required=True, exempt=("/health",))
    lenient = RolloutContextMiddleware(app)
    resources = Resources(world.transport, RUN, "res-strict")
    await resources.register()
    guarded = ResourcesMiddleware(app, resources, rollout_id_required=True, exempt=("/health",))
    for wrapped, required in ((strict, True), (guarded, True), (lenient, False)):
        transport = httpx.ASGITransport(app=wrapped)
        async with httpx.AsyncClient(transport=transport, base_url="http://p.test") as client:
            bare = await client.post("/generate")
            if required:
                assert bare.status_code == 400, bare.text
                error = bare.json()["error"]
                assert error["code"] == "invalid_request" and CAPTURE_KEY_HEADER in error["message"]
            else:
                assert bare.json() == {"context": None}  # passes through, as before
            headers = context_headers(RolloutContext("r1", 1))
            assert (await client.post("/generate", headers=headers)).json() == {"context": "r1-a1"}
            assert (await client.get("/health")).status_code == 200  # exempt
