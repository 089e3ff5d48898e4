"""The rollout context of a request, read from its headers (middleware and FastAPI dependency)."""

from __future__ import annotations

from typing import Annotated

import httpx
from fastapi import Depends, FastAPI

from rolloutlog.participants import (
    CAPTURE_KEY_HEADER,
    STEP_HEADER,
    RolloutContext,
    RolloutContextMiddleware,
    context_headers,
    current_context,
    rollout_context,
)


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
