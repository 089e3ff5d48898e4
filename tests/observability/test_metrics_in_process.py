"""Metrics through the app in process: the route label of every kind of route, and
``rolloutlog_generation_cuts_total{disposition}`` (what restores did with generation cuts)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import factories as f
from tests.api.conftest import Api, open_api, settings_for


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async with open_api(settings_for(tmp_path / "data")) as opened:
        yield opened


async def _cuts(api: Api) -> dict[str, float]:
    text = (await api.client.get("/metrics")).text
    return {
        sample.labels["disposition"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "rolloutlog_generation_cuts"
        for sample in family.samples
    }


async def test_restores_count_continued_invalid_and_policy_dropped_cuts(api: Api) -> None:
    await api.seed(["a", "b", "c"])
    await api.register("policy-0", "policy")
    # a: a committed ledger row, then a call in flight: its chunks are a cut to continue.
    await api.append(f.ledger_row("a", "c1", [1], policy_version=4), f.boundary("a", "s2"))
    await api.append(f.chunk("a", "c2", 0, 4))
    # c: a cut whose parent call is in no ledger: it cannot be continued, the episode restarts.
    await api.append(f.chunk("c", "c2", 0, 4))
    # b has no cut: not counted.
    none = {"continued": 0, "terminal": 0, "dropped_by_policy": 0, "restart_invalid": 0}
    assert await _cuts(api) == none

    await api.checkpoint()
    first = await api.restore()
    assert await _cuts(api) == {**none, "restart_invalid": 1}
    # The continued cut is counted when the restore's projections are first read, once.
    projections = f"/v1/runs/{api.run}/restores/{{}}/projections"
    await api.call(
        "GET", f"/v1/runs/{api.run}/episodes/a/projection?restore=latest", "participant", 200
    )
    await api.call("GET", projections.format(first["restore_id"]), "participant", 200)
    assert await _cuts(api) == {**none, "continued": 1, "restart_invalid": 1}

    # The cut survives the next checkpoint; a restore under a policy newer than it drops it
    # (generated under version 1, older than 5 - 2).
    await api.checkpoint()
    second = await api.restore(policy_version=5, max_policy_lag=2)
    assert second["restore_id"] > first["restore_id"]
    await api.call(
        "GET",
        projections.format(second["restore_id"]),
        "participant",
        200,
    )
    assert await _cuts(api) == {
        **none,
        "continued": 1,
        "restart_invalid": 1,
        "dropped_by_policy": 1,
    }


async def test_requests_are_labelled_by_route_template_never_by_path(api: Api) -> None:
    for path, status in (
        ("/ui/static/app.css", 200),  # a mount
        ("/openapi.json", 200),  # a plain Starlette route
        ("/v1/runs/nope", 401),  # an API route that refused (no token)
        ("/no/such/route", 404),
        ("/no/such/other/route", 404),
    ):
        assert (await api.client.get(path)).status_code == status
    text = (await api.client.get("/metrics")).text
    counts = {
        (sample.labels["route"], sample.labels["status"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "rolloutlog_http_request_duration_seconds"
        for sample in family.samples
        if sample.name.endswith("_count")
    }
    assert counts[("/ui/static/{path}", "200")] == 1
    assert counts[("/openapi.json", "200")] == 1
    assert counts[("/v1/runs/{run}", "401")] == 1
    assert counts[("(unmatched)", "404")] == 2
