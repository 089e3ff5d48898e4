"""The dashboard with a token scoped to some runs, in a real browser against a real server: the
runs page lists the token's runs only, a run of its scope opens as with any token, a fork of a run
out of it does not name its source (no link either), and a run out of it shows the refusal and
what to do (no page error, no request off the service)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import factories as f
from tests.api.conftest import bearer, wire
from tests.api.test_auth import SCOPED, scoped_server
from tests.api.test_e2e import Server

INSIDE, OUTSIDE = "exp-shown", "other-hidden"
#: A fork of ``OUTSIDE`` in the token's scope.
FORK = "exp-fork-of-hidden"


@pytest.fixture(scope="module")
def scoped(chromium: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with (
        scoped_server(Path(tmp_path_factory.mktemp("ui-scoped"))) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        for run in (INSIDE, OUTSIDE):
            made = client.post(
                "/v1/runs", json={"run": run, "partitions": 2}, headers=bearer("admin")
            )
            assert made.status_code == 201, made.text
            client.post(
                f"/v1/runs/{run}/participants",
                json={"id": "env-0", "kind": "environment"},
                headers=bearer("participant"),
            ).raise_for_status()
            events = wire(f.started("ep"), f.boundary("ep", "seed", {"turn": 1}))
            client.post(
                f"/v1/runs/{run}/events", json=events, headers=bearer("participant")
            ).raise_for_status()
        epoch = client.post(f"/v1/runs/{OUTSIDE}/controller", headers=bearer("admin")).json()
        client.post(
            f"/v1/runs/{OUTSIDE}/checkpoints", json=epoch, headers=bearer("admin")
        ).raise_for_status()
        forked = client.post(
            "/v1/runs", json={"run": FORK, "fork": {"run": OUTSIDE}}, headers=bearer("trainer")
        )
        assert forked.status_code == 201, forked.text
        yield server


async def test_a_scoped_token_sees_its_runs_and_is_told_about_the_others(
    chromium: str, scoped: Server
) -> None:
    from playwright.async_api import async_playwright

    problems: list[str] = []
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            context = await launched.new_context()
            await context.add_init_script(
                f"sessionStorage.setItem('rolloutlog.token', '{SCOPED['analyst']}')"
            )
            page = await context.new_page()
            page.set_default_timeout(10_000)
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            page.on("requestfailed", lambda r: problems.append(f"failed: {r.url}"))

            def on_response(response: Any) -> None:
                if response.status >= 400 and OUTSIDE not in response.url:
                    problems.append(f"{response.status} {response.url}")

            page.on("response", on_response)
            await page.goto(f"{scoped.url}/ui")
            await page.wait_for_selector(f'tr[data-run="{INSIDE}"]')
            rows = await page.locator("tr[data-run]").evaluate_all(
                "rows => rows.map(r => r.dataset.run)"
            )
            assert sorted(rows) == [FORK, INSIDE]
            assert await page.locator(f'tr[data-run="{OUTSIDE}"]').count() == 0
            origin = await page.inner_text(f'tr[data-run="{FORK}"] [data-field="forked_from"]')
            assert origin == "checkpoint 1 of a run out of this token's scope", origin
            await page.wait_for_load_state("networkidle")
            await page.click(f'tr[data-run="{FORK}"] a')
            await page.wait_for_url(f"**/ui/runs/{FORK}")
            await page.wait_for_selector("tr[data-checkpoint]")
            lineage = page.locator("[data-testid=lineage]")
            text = await lineage.inner_text()
            assert text.startswith("Forked from a run out of this token's scope at checkpoint 1"), (
                text
            )
            assert await lineage.locator("a").count() == 0
            assert OUTSIDE not in await page.content()
            assert "null" not in text
            await page.wait_for_load_state("networkidle")
            await page.goto(f"{scoped.url}/ui")
            await page.wait_for_selector(f'tr[data-run="{INSIDE}"]')
            await page.click(f'tr[data-run="{INSIDE}"] a')
            await page.wait_for_url(f"**/ui/runs/{INSIDE}")
            await page.wait_for_selector("tr[data-participant]")
            await page.wait_for_load_state("networkidle")  # (leaving it would abort a request)
            await page.goto(f"{scoped.url}/ui/runs/{OUTSIDE}")
            refusal = await page.wait_for_selector("[data-testid=auth-error]")
            text = await refusal.inner_text()
            assert "forbidden: this token holds the analyst role for other runs" in text, text
            assert "enter one that holds this run" in text, text
        finally:
            await launched.close()
    assert not problems, problems
