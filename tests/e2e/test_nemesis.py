"""The nemesis in CI: one short seeded schedule (every fault kind once, in a random order: a
replica SIGKILLed and restarted, a replica SIGSTOPped past its lease, the broker SIGSTOPped,
every broker connection reset, the catalog SIGKILLed and restarted) over three replicas on
Tansu and a throwaway PostgreSQL, under appends, checkpoints and restores through random
replicas; and the broker SIGKILLed (restarted empty) as its own case. See ``_nemesis.py``.

The seed is printed first; ``ROLLOUTLOG_NEMESIS_SEED=S`` replays a schedule.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.e2e._nemesis import (
    LIVENESS_BOUND_S,
    SEED_VARIABLE,
    WRITERS,
    Nemesis,
    Workload,
    broker_lost,
    liveness_failures,
    nemesis_world,
    schedule,
    seed_from_env,
)

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]


@pytest.mark.timeout(420)
async def test_nemesis_schedule(tmp_path: Path) -> None:
    seed = seed_from_env()
    faults = schedule(seed)
    print(f"nemesis seed {seed} ({SEED_VARIABLE}={seed}): {[x.describe() for x in faults]}")
    async with nemesis_world(tmp_path) as world:
        workload = Workload(world, seed)
        try:
            await workload.setup()
            tasks = [asyncio.create_task(workload.writer(i)) for i in range(WRITERS)]
            tasks.append(asyncio.create_task(workload.trainer()))
            try:
                await Nemesis(world, workload).run(faults)
            finally:
                workload.stop.set()
                await asyncio.gather(*tasks)
            print(f"nemesis seed {seed}: {workload.figures()}")
            await workload.settle()
            await workload.verify()
            failures = liveness_failures(faults)
            assert not failures, (
                f"seed {seed}: liveness (bound {LIVENESS_BOUND_S} s) failed: {failures}"
            )
        except BaseException:
            print(f"nemesis seed {seed} failed; replay with {SEED_VARIABLE}={seed}")
            print(world.replicas.tails())
            raise
        finally:
            await workload.close()


@pytest.mark.timeout(240)
async def test_broker_lost_stops_the_run(tmp_path: Path) -> None:
    """The broker SIGKILLed under the workload and restarted empty (Tansu keeps memory only):
    every replica reports the run ``stopped``, appends and checkpoints answer ``503 run_lost``,
    the run's topic is never re-created; what was acknowledged before was in the log."""
    seed = seed_from_env()
    print(f"nemesis seed {seed} ({SEED_VARIABLE}={seed})")
    async with nemesis_world(tmp_path) as world:
        workload = Workload(world, seed)
        try:
            await workload.setup()
            tasks = [asyncio.create_task(workload.writer(i)) for i in range(WRITERS)]
            tasks.append(asyncio.create_task(workload.trainer()))
            try:
                start = asyncio.get_running_loop().time()
                while not workload.commits:
                    assert asyncio.get_running_loop().time() < start + 60, "no checkpoint"
                    await asyncio.sleep(0.2)
                await asyncio.sleep(3)
            finally:
                workload.stop.set()
                await asyncio.gather(*tasks)
            await workload.appends.check_log(world.log_url)
            assert not workload.violations, workload.violations
            await broker_lost(world, workload)
        except BaseException:
            print(f"nemesis seed {seed} failed; replay with {SEED_VARIABLE}={seed}")
            print(world.replicas.tails())
            raise
        finally:
            await workload.close()
