"""The projector's fold rate on Kafka: a run appended straight into the log, then read and
folded from offset 0 by fresh projectors, without a service.
"""

from __future__ import annotations

import gc
import time
import uuid
from typing import Any

from _common import append_in_chunks, summary
from suite_service import PARTITIONS
from workloads import Workload

from rolloutlog.log import open_log
from rolloutlog.projections._projector import Projector, StartPlan


async def fold_rate(kafka: str, workload: Workload, runs: int) -> dict[str, Any]:
    """How fast a projector reads and folds a run from Kafka: the workload is appended straight
    into the log (no service), then ``runs`` fresh projectors each catch up from offset 0; the
    rate is records folded per second of catch-up (read from the broker + fold, one process)."""
    run = f"fold-{uuid.uuid4().hex[:6]}"
    async with open_log(f"kafka://{kafka}?topic_prefix=f{uuid.uuid4().hex[:8]}.") as log:
        await log.ensure_run(run, PARTITIONS)
        await append_in_chunks(log.append, run, workload.episodes(), chunk_size=2000, window=8)
        records = sum(await log.end_offsets(run))
        rates, seconds = [], []
        for _ in range(runs):
            projector = Projector(log, run, PARTITIONS)

            async def plan() -> StartPlan:
                return StartPlan([0] * PARTITIONS)

            t0 = time.perf_counter()
            projector.launch(plan)
            await projector.settled.wait()
            elapsed = time.perf_counter() - t0
            assert projector.health.status == "ok", projector.health
            assert projector.events_applied == records, (projector.events_applied, records)
            assert len(projector.trackers) >= workload.live, len(projector.trackers)
            await projector.stop()
            del projector
            gc.collect()
            seconds.append(elapsed)
            rates.append(records / elapsed)
        await log.delete_run(run)
    return {
        "records": records,
        "live": workload.live,
        "catch_up_s": summary(seconds),
        "events_per_s": summary(rates),
    }
