"""The dashboard shows the fork tree: a fork right after its source on the runs page, indented,
saying what it was forked from; each run's page links its source and its forks."""

from __future__ import annotations

from tests.api.conftest import bearer
from tests.ui.conftest import Browser, Served


def _fork(served: Served, run: str, source: str) -> None:
    reply = served.client.post(
        "/v1/runs", json={"run": run, "fork": {"run": source}}, headers=bearer("trainer")
    )
    assert reply.status_code == 201, reply.text


async def test_runs_page_and_run_pages_show_the_fork_tree(browser: Browser, served: Served) -> None:
    _fork(served, "zz-fork", served.run)  # sorts after every other run by name
    _fork(served, "zz-fork-of-fork", "zz-fork")
    page = browser.page
    await browser.open("/ui")
    await page.wait_for_selector('tr[data-run="zz-fork-of-fork"]')
    rows = await page.locator("tr[data-run]").evaluate_all(
        "rows => rows.map(r => [r.dataset.run, r.dataset.depth])"
    )
    names = [name for name, _ in rows]
    at = names.index(served.run)
    assert rows[at : at + 3] == [[served.run, "0"], ["zz-fork", "1"], ["zz-fork-of-fork", "2"]]
    origin = await page.inner_text('tr[data-run="zz-fork"] [data-field="forked_from"]')
    assert origin == f"{served.run}@{served.get(f'/v1/runs/{served.run}')['latest_checkpoint_id']}"

    await page.wait_for_load_state("networkidle")
    await page.click('tr[data-run="zz-fork"] a')
    await page.wait_for_url("**/ui/runs/zz-fork")
    await page.wait_for_selector("tr[data-checkpoint]")  # the page has loaded
    lineage = page.locator("[data-testid=lineage]")
    await lineage.locator('[data-fork="zz-fork-of-fork"]').wait_for()
    assert await lineage.locator('[data-field="forked_from"]').inner_text() == served.run
    await page.wait_for_load_state("networkidle")  # no request cut short by leaving
    await lineage.locator('[data-field="forked_from"]').click()
    await page.wait_for_url(f"**/ui/runs/{served.run}")
    await page.wait_for_selector("tr[data-checkpoint]")
    await page.locator('[data-testid=lineage] [data-fork="zz-fork"]').wait_for()
    browser.check_clean()
