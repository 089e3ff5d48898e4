"""The dashboard in a real browser: each page loads without a console error or a failed
request, shows the numbers the REST API answers, and its links lead where they say."""

from __future__ import annotations

from typing import Any

from playwright.async_api import expect

from tests.ui.conftest import Browser, Served


async def _field(page: object, scope: str, name: str) -> str:
    text: str = await page.inner_text(f'{scope} [data-field="{name}"]')  # type: ignore[attr-defined]
    return text.replace(",", "")


async def test_runs_page_shows_the_apis_numbers(browser: Browser, served: Served) -> None:
    await browser.open("/ui")
    row = f'tr[data-run="{served.run}"]'
    await browser.page.wait_for_selector(row)
    run = served.get(f"/v1/runs/{served.run}")
    lag = served.get(f"/v1/runs/{served.run}/projector")
    assert await _field(browser.page, row, "live_episodes") == str(run["counts"]["live_episodes"])
    assert await _field(browser.page, row, "episodes") == str(run["counts"]["episodes"])
    assert await _field(browser.page, row, "latest_checkpoint_id") == str(
        run["latest_checkpoint_id"]
    )
    assert await _field(browser.page, row, "restores") == str(run["counts"]["restores"]) == "1"
    assert await _field(browser.page, row, "participants") == "2"
    assert await _field(browser.page, row, "lag") == str(lag["lag"])
    await browser.page.click(f"{row} a")
    await browser.page.wait_for_url(f"**/ui/runs/{served.run}")
    await browser.page.wait_for_selector("tr[data-checkpoint]")
    browser.check_clean()


async def test_run_page_checkpoints_restores_plan_and_participants(
    browser: Browser, served: Served
) -> None:
    page = browser.page
    await browser.open(f"/ui/runs/{served.run}")
    await page.wait_for_selector("tr[data-checkpoint]")
    checkpoints = served.get(f"/v1/runs/{served.run}/checkpoints")["checkpoints"]
    assert await page.locator("tr[data-checkpoint]").count() == len(checkpoints) == 1
    one = f'tr[data-checkpoint="{checkpoints[0]["checkpoint_id"]}"]'
    for action in ("continue", "restart", "finished"):
        assert await _field(page, one, action) == str(checkpoints[0]["counts"][action])
    # the duration chart draws one stacked bar per stage of the checkpoint
    stages = [s for s in checkpoints[0]["timings_ms"] if s != "total"]
    assert await page.locator("[data-testid=chart-durations] rect").count() == len(stages)
    assert await page.locator("[data-testid=chart-lag] rect").count() == 2  # two partitions

    restores = served.get(f"/v1/runs/{served.run}/restores")["restores"]
    restore = restores[0]
    row = f'tr[data-restore="{restore["restore_id"]}"]'
    for action in ("continue", "restart", "excluded"):
        assert await _field(page, row, action) == str(restore["counts"][action])
    assert restore["counts"] == {"continue": 1, "restart": 1, "excluded": 1}

    await page.click(f'[data-testid="show-plan-{restore["restore_id"]}"]')
    await page.wait_for_selector("[data-testid=plan] tr[data-episode]")
    plan = served.get(f"/v1/runs/{served.run}/restores/{restore['restore_id']}/episodes")
    assert await _field(page, "[data-testid=plan]", "plan_count") == str(len(plan["episodes"]))
    await page.select_option("[data-testid=plan-action]", "restart")
    await expect(page.locator("[data-testid=plan] tr[data-episode]")).to_have_count(1)
    restarted = await page.inner_text("[data-testid=plan] tr[data-episode]")
    assert (
        "ep-c" in restarted
        and "restart-only session sandbox of resources server res-0" in restarted
    )
    await page.select_option("[data-testid=plan-action]", "")
    await page.wait_for_selector('[data-testid=plan] tr[data-episode="ep-e"]')
    await page.fill("[data-testid=plan-search]", "ep-e")
    assert await page.locator("[data-testid=plan] tr[data-episode]").count() == 1
    assert "excluded" in await page.inner_text('[data-testid=plan] tr[data-episode="ep-e"]')

    participants = served.get(f"/v1/runs/{served.run}/participants")["participants"]
    assert await page.locator("tr[data-participant]").count() == len(participants)

    # the events/s chart fills in as the page refreshes itself
    await page.wait_for_selector("[data-testid=chart-rate] path", state="attached", timeout=15_000)
    await page.click('[data-testid=plan] tr[data-episode="ep-e"] a')
    await page.wait_for_url(f"**/ui/runs/{served.run}/episodes/ep-e")
    await page.wait_for_selector("[data-testid=attempts]")
    browser.check_clean()


async def test_episode_page_attempts_timeline_and_payload(browser: Browser, served: Served) -> None:
    page = browser.page
    await browser.open(f"/ui/runs/{served.run}/episodes/ep-c")
    await page.wait_for_selector("[data-testid=timeline] tr[data-offset]")
    history = served.get(f"/v1/runs/{served.run}/episodes/ep-c")
    summary = "[data-testid=summary]"
    assert await _field(page, summary, "current_attempt") == str(history["current_attempt"]) == "1"
    assert await _field(page, summary, "event_count") == str(history["event_count"])
    assert await page.locator("[data-testid=attempts] tr[data-attempt]").count() == 2
    why = await page.inner_text('[data-testid=attempts] tr[data-attempt="1"]')
    assert "restart-only session sandbox of resources server res-0 open at the cut" in why
    assert await page.locator("[data-testid=timeline] tr[data-offset]").count() == len(
        history["events"]
    )
    first = history["events"][0]
    await page.click(f'[data-testid="event-{first["offset"]}"]')
    await page.wait_for_selector("[data-testid=payload] pre")
    shown = await page.inner_text("[data-testid=payload] pre")
    assert '"task"' in shown and first["type"] in shown

    await browser.open(f"/ui/runs/{served.run}/episodes/ep-d")
    await page.wait_for_selector('[data-testid=attempts] tr[data-attempt="1"]')
    resumed = await page.inner_text('[data-testid=attempts] tr[data-attempt="1"]')
    assert "continued from checkpoint" in resumed and "stage seed" in resumed
    await page.click("#crumbs a >> nth=1")
    await page.wait_for_url(f"**/ui/runs/{served.run}")
    await page.wait_for_selector("tr[data-checkpoint]")
    browser.check_clean()


async def test_api_documents_load_offline(browser: Browser) -> None:
    page = browser.page
    await browser.open("/docs")
    await page.wait_for_selector(".swagger-ui .opblock-tag")
    tags = await page.locator(".swagger-ui .opblock-tag").all_inner_texts()
    names = {t.split("\n")[0].strip() for t in tags}
    assert {"runs", "events", "checkpoints", "restores", "analysts", "operations"} <= names
    browser.check_clean()


async def test_run_page_names_what_holds_the_run_back(browser: Browser, served: Served) -> None:
    """A lone replica cannot be held back by another; the reply of another replica's view is
    stood in for (the cross-replica judgement itself is tested on real replicas in
    tests/e2e/test_replica_health.py): the page shows each blocker's partition and replica."""
    page = browser.page
    await browser.open(f"/ui/runs/{served.run}")
    await page.wait_for_selector("[data-testid=held-back-none]")
    blocker = {
        "partition": 1,
        "replica": "r3",
        "state": "catching_up",
        "reason": "replica r3: starting: catching up with the log",
        "since": 1764400000.0,
        "lag": 4200,
    }

    async def held_back(route: Any) -> None:
        reply = await route.fetch()
        body = await reply.json()
        body["health"] = {**body["health"], "status": "degraded", "held_back": [blocker]}
        await route.fulfill(response=reply, json=body)

    await page.route(f"**/v1/runs/{served.run}", held_back)
    row = "[data-testid=held-back] tr[data-partition='1']"
    await page.wait_for_selector(row, timeout=15_000)  # at the page's next refresh
    assert await _field(page, row, "replica") == "r3"
    assert await _field(page, row, "lag") == "4200"
    assert "catching_up" in await page.inner_text(row)
    browser.check_clean()
