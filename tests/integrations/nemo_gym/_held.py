"""NeMo Gym's stateful counter with tool calls a test can park (imported in the Gym's venv:
name it as the server's ``rolloutlog.server_class``).

The config's top-level ``tool_holds`` (a JSON string, ignored by NeMo Gym) says which to park:
``{"dir": D, "calls": {capture key: [route, n]}}``: the ``n``-th request (from 1) to ``/route``
under that capture key never answers (its server is killed under it); the server writes
``D/parked-<capture key>`` when it parks one. Replacement attempts (``-a1``) have other keys.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from resources_servers.example_session_state_mgmt.app import StatefulCounterResourcesServer

from rolloutlog.participants import CAPTURE_KEY_HEADER

#: The top-level config key of the holds.
HOLDS_KEY = "tool_holds"


class _Park:
    def __init__(self, app: Any, holds: dict[str, Any]) -> None:
        self.app = app
        self.directory = Path(holds["dir"])
        self.calls = {key: (str(route), int(n)) for key, (route, n) in holds["calls"].items()}
        self.seen: Counter[tuple[str, str]] = Counter()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers", ()))
            key = headers.get(CAPTURE_KEY_HEADER.encode(), b"").decode()
            route = str(scope["path"]).lstrip("/")
            self.seen[key, route] += 1
            if self.calls.get(key) == (route, self.seen[key, route]):
                (self.directory / f"parked-{key}").write_text(route)
                await asyncio.Event().wait()  # until the server is killed
        await self.app(scope, receive, send)


class HeldCounter(StatefulCounterResourcesServer):  # type: ignore[misc]
    def setup_webserver(self) -> FastAPI:
        app: FastAPI = super().setup_webserver()
        holds = self.server_client.global_config_dict.get(HOLDS_KEY)
        if holds:
            app.add_middleware(_Park, holds=json.loads(str(holds)))
        return app
