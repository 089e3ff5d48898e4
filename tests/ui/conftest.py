"""A real ``rolloutlog serve`` holding a run with events, a checkpoint and a restore, and
headless Chromium (Debian's, driven by Playwright; Playwright's own browsers are never fetched)."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import factories as f
from tests._services import unavailable
from tests.api.conftest import TOKENS, bearer, wire
from tests.e2e._harness import Deployment, Service

CHROMIUM = "/usr/bin/chromium"
RUN = "ui-demo"


@dataclass
class Served:
    url: str
    run: str
    client: httpx.Client

    def get(self, path: str, **params: Any) -> Any:
        reply = self.client.get(path, params=params, headers=bearer("analyst"))
        assert reply.status_code == 200, reply.text
        return reply.json()


def _seed(client: httpx.Client) -> None:
    """Five episodes: two finish, one holds a restart_only session at the cut (restart), one is
    excluded by the restore, the rest continue; one more starts after the restore."""

    def call(method: str, path: str, role: str, body: Any, expect: int) -> Any:
        reply = client.request(method, path, json=body, headers=bearer(role))
        assert reply.status_code == expect, reply.text
        return reply.json()

    call("POST", "/v1/runs", "trainer", {"run": RUN, "partitions": 2}, 201)
    runs = f"/v1/runs/{RUN}"
    call("POST", f"{runs}/participants", "participant", {"id": "env-0", "kind": "environment"}, 201)
    call("POST", f"{runs}/participants", "participant", {"id": "res-0", "kind": "resources"}, 201)
    epoch = call("POST", f"{runs}/controller", "trainer", None, 200)["controller_epoch"]
    events = []
    for episode in ("ep-a", "ep-b", "ep-c", "ep-d", "ep-e"):
        events += [f.started(episode, step=0), f.step_started(episode, "seed", step=0)]
        if episode == "ep-c":  # open at its boundary: the checkpoint can only restart it
            events.append(f.session_started("ep-c", "sandbox"))
        events.append(f.boundary(episode, "seed", {"turn": 1}, nxt="act", step=0))
    events += [f.finished("ep-a", step=1), f.finished("ep-b", step=1)]
    call("POST", f"{runs}/events", "participant", wire(*events), 200)
    checkpoint = call("POST", f"{runs}/checkpoints", "trainer", {"controller_epoch": epoch}, 201)
    call(
        "POST",
        f"{runs}/restores",
        "trainer",
        {
            "controller_epoch": epoch,
            "checkpoint_id": checkpoint["checkpoint_id"],
            "exclude": ["ep-e"],
        },
        201,
    )
    later = [f.started("ep-f", step=0), f.boundary("ep-f", "seed", {"turn": 1}, step=0)]
    call("POST", f"{runs}/events", "participant", wire(*later), 200)
    # The service folds records and registers episodes after it acknowledges them: the run is
    # seeded once the catalog counts all six and the projector has nothing left to fold, so
    # that a page and the API, read one after the other, answer the same numbers.
    deadline = time.monotonic() + 30
    while True:
        counts = call("GET", runs, "analyst", None, 200)["counts"]
        lag = call("GET", f"{runs}/projector", "analyst", None, 200)["lag"]
        if counts["episodes"] == 6 and lag == 0:
            return
        assert time.monotonic() < deadline, f"the seeded run did not settle: {counts}, lag {lag}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def served(chromium: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    workdir = tmp_path_factory.mktemp("ui")
    service = Service(Deployment("embedded", Path(workdir) / "data"), Path(workdir))
    asyncio.run(service.start())
    try:
        with httpx.Client(base_url=service.url, timeout=30) as client:
            _seed(client)
            yield Served(service.url, RUN, client)
    finally:
        service.stop()


@dataclass
class Browser:
    """One page, with every console error, page error and failed or refused request kept."""

    page: Any
    base: str
    problems: list[str] = field(default_factory=list)
    requested: list[str] = field(default_factory=list)

    async def open(self, path: str) -> None:
        await self.page.goto(self.base + path)

    def check_clean(self) -> None:
        assert not self.problems, self.problems
        foreign = [
            url for url in self.requested if not url.startswith((self.base, "data:", "blob:"))
        ]
        assert not foreign, f"requests off the service (a CDN?): {foreign}"


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium (``.ci/run`` installs it): skipped locally, failed in CI, when absent."""
    if not Path(CHROMIUM).exists():
        unavailable(f"{CHROMIUM} is missing (apt-get update && apt-get install -y chromium)")
    if importlib.util.find_spec("playwright") is None:
        unavailable("playwright is not installed (pip install -e '.[test]')")
    return CHROMIUM


@pytest.fixture
async def browser(chromium: str, served: Served) -> AsyncIterator[Browser]:
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"]
        )
        context = await launched.new_context(viewport={"width": 1400, "height": 1000})
        # The token as a user enters it once: in the tab's sessionStorage.
        await context.add_init_script(
            f"sessionStorage.setItem('rolloutlog.token', '{TOKENS['analyst']}')"
        )
        page = await context.new_page()
        page.set_default_timeout(10_000)
        opened = Browser(page, served.url)

        def on_console(message: Any) -> None:
            if message.type == "error":
                opened.problems.append(f"console: {message.text}")

        def on_response(response: Any) -> None:
            if response.status >= 400:
                opened.problems.append(f"{response.status} {response.url}")

        page.on("console", on_console)
        page.on("pageerror", lambda error: opened.problems.append(f"page error: {error}"))
        page.on("requestfailed", lambda r: opened.problems.append(f"failed: {r.url}"))
        page.on("response", on_response)
        page.on("request", lambda r: opened.requested.append(r.url))
        try:
            yield opened
        finally:
            await launched.close()
