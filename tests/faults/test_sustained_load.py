"""Sustained load on both deployments: a real ``rolloutlog serve``, 12 concurrent HTTP appenders
and a checkpoint every second for ``ROLLOUTLOG_LOAD_S`` seconds (30 in CI). Every checkpoint
commits; at the end every acknowledged event is in the log at its offset and in the fold (a
finished episode was reported finished, a live one is continued at its last acknowledged
boundary).

On Kafka this is the load failure Tansu causes: Tansu answers some fetches empty below the high-water
mark under this load, which used to kill the run's projector within seconds.
"""

from __future__ import annotations

import os

import pytest

from rolloutlog.log import open_log
from rolloutlog.trainer import AsyncTrainerClient
from tests.api.conftest import TOKENS
from tests.e2e._harness import Deployment, Service
from tests.faults._kafka import HttpLoad

pytestmark = pytest.mark.slow

LOAD_S = float(os.environ.get("ROLLOUTLOG_LOAD_S", "30"))
RUN = "load"


@pytest.mark.timeout(LOAD_S + 120)
async def test_appends_and_a_checkpoint_every_second(
    deployment: Deployment, service: Service
) -> None:
    async with AsyncTrainerClient(service.url, token=TOKENS["admin"], timeout_s=60) as trainer:
        await trainer.create_run(RUN, partitions=4)
        await trainer.take_over(RUN)
        load = HttpLoad(service.url, RUN, trainer, appenders=12)
        await load.run_for(LOAD_S, checkpoint_every_s=1.0)
        assert len(load.checkpoints) >= max(3, LOAD_S // 5), "checkpoints did not keep up"
        assert not load.refused, f"appends refused without a fault: {load.refused[:3]}"
        await load.assert_in_the_fold()
        kept_from = await load.kept_from()
    service.stop()
    log = open_log(deployment.log_url or deployment.data_dir)
    async with log:
        await load.assert_in_the_log(log, kept_from)
    print(
        f"{deployment.name}: {len(load.acked)} events acknowledged, {len(load.checkpoints)} checkpoints"
    )
