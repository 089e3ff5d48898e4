"""Audit lines and stage durations of refused checkpoints and restores (through the app in
process; the committed ones are checked against a real server in ``test_real_server``)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import Api, open_api, settings_for


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async with open_api(settings_for(tmp_path / "data")) as opened:
        yield opened


async def test_a_refused_restore_and_checkpoint_are_audited_with_their_code(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    await api.seed(["a"])
    await api.checkpoint()
    stale = api.epoch
    await api.take_over()  # another trainer took over: the old epoch is stale
    caplog.set_level(logging.INFO, logger="rolloutlog.audit")
    await api.restore(controller_epoch=stale, expect=409)
    response = await api.call(
        "POST",
        "/v1/runs/nope/checkpoints",
        "trainer",
        404,
        json={"controller_epoch": 1},
        headers={"X-Request-ID": "ck-nope"},
    )
    assert response.headers["x-request-id"] == "ck-nope"
    lines = [r for r in caplog.records if r.name == "rolloutlog.audit"]
    assert [(r.audit, r.outcome) for r in lines] == [
        ("restore", "stale_controller"),
        ("checkpoint", "unknown_run"),
    ]
    restore, checkpoint = lines
    assert restore.who == {
        "roles": ["trainer"],
        "token": restore.who["token"],
        "client": "127.0.0.1",
    }
    assert restore.controller_epoch == stale
    assert checkpoint.run == "nope" and checkpoint.request_id == "ck-nope"
    assert checkpoint.trace_id is None  # tracing is off here

    text = (await api.client.get("/metrics")).text
    totals = {
        (s.labels["stage"], s.labels["outcome"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name in ("rolloutlog_restore_duration_seconds",)
        for s in family.samples
        if s.name.endswith("_count")
    }
    assert totals == {("total", "stale_controller"): 1}
