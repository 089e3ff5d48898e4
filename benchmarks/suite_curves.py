"""The suite's curves: checkpoint and restore latency against live rollouts and against state
size, on each deployment. A point's episodes are preloaded in bulk straight into the deployment's
log (``suite_service.bulk_preload``), then measured over REST on the restarted service like a
workload; its stop-the-world baseline is measured once and shared by the deployments.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from _common import DEPLOYMENTS, log
from baselines import stw_point
from suite_service import PARTITIONS, Deployment, bulk_preload, caught_up, service
from suite_workload import checkpoints_and_restores
from workloads import Workload, live_point, state_point

from rolloutlog.log import open_log
from rolloutlog.trainer import AsyncTrainerClient


async def curve_point(
    deployment: Deployment, workload: Workload, runs: int, restores: int
) -> dict[str, Any]:
    """One curve point on a fresh service of ``deployment``: the run created over REST, its
    episodes preloaded in bulk (``bulk_preload``), then measured like a workload. On Kafka the
    run's topics are deleted afterwards (Tansu keeps them in memory as long as it runs)."""
    with service(deployment) as svc:
        run = f"{workload.name}-{workload.count}-{workload.state_bytes}"
        async with AsyncTrainerClient(svc.url) as trainer:
            await trainer.create_run(run, PARTITIONS)
        preload_s, restart_s = await bulk_preload(svc, run, workload)
        async with AsyncTrainerClient(svc.url) as trainer:
            await trainer.take_over(run)
            try:
                catch_up_s = await caught_up(trainer, run, workload.live, timeout_s=600)
            except RuntimeError:
                log(f"the service's log (last lines):\n{svc.log_tail()}")
                raise
            out = await checkpoints_and_restores(svc, trainer, run, workload, runs, restores)
            out["service_peak_rss_mb"] = svc.peak_rss_mb()
        svc.stop()
        if deployment.log_url:
            async with open_log(deployment.log_url) as kafka_log:
                await kafka_log.delete_run(run)
    out.update(
        {
            "live": workload.live,
            "state_bytes": workload.state_bytes,
            "preload_s": preload_s,
            "restart_s": restart_s,
            "catch_up_s": catch_up_s,
        }
    )
    return out


#: Runs at curve points, fewer than the workloads' (``--runs``) so that the whole suite stays
#: within ~15 minutes here: live checkpoints, restores (each after its floor, and every one but
#: the first after a checkpoint), restores at the largest live-rollouts point, stop-the-world
#: checkpoints (each with its restore). Every figure's ``runs`` says how many it took.
CURVE_RUNS = {"checkpoints": 3, "restores": 2, "largest_restores": 1, "stop_the_world": 3}


#: Wall seconds a curve point is expected to take here (the largest live-rollouts point: its
#: preload, catch-up, checkpoints, restore and stop-the-world runs; any other: ~10-25 s): a point
#: starts only if the suite's ``--budget-s`` still has that much room.
POINT_S = {"largest": 150.0, "other": 25.0}


def measure_curves(
    results: dict[str, Any],
    backends: list[str],
    kafka: str | None,
    quick: bool,
    started: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Checkpoint and restore against live rollouts and against state size, on each deployment.

    Every point but the main part's S1 (the 16,000 live-rollouts point, reused with its runs) is
    preloaded in bulk (``curve_point``). The stop-the-world baseline of a point is measured once
    and shared by the deployments. Points run smallest first, each deployment in turn; the largest
    live point of each deployment comes last, within ``--budget-s``."""
    live_counts = [500, 1000] if quick else [1000, 4000, 16_000, 64_000]
    state_sizes = [1024, 1024 * 1024] if quick else [1024, 32 * 1024, 1024 * 1024]
    if args.live_points is not None:  # a before/after of a few points
        live_counts = [int(x) for x in args.live_points.split(",") if x]
    if args.state_points is not None:
        state_sizes = [int(x) for x in args.state_points.split(",") if x]
    state_count = 50 if quick else 200
    counts = {key: 2 if quick else n for key, n in CURVE_RUNS.items()}
    largest = max(live_counts, default=0)
    plan = [
        (name, curve, x)
        for name in backends
        for curve, x in [("live", c) for c in live_counts if c != largest]
        + [("state", size) for size in state_sizes]
    ]
    plan += [(name, "live", largest) for name in backends]
    stw: dict[tuple[str, int], dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for name, curve, x in plan:
        deployment = Deployment(name, kafka if name == "kafka" else None)
        mine = out.setdefault(
            name,
            {
                "live_rollouts": {},
                "state_bytes": {},
                "state_rollouts": state_count,
                "runs": counts,
            },
        )
        main_s1 = results["deployments"].get(name, {}).get("S1")
        elapsed = time.perf_counter() - started
        reused = curve == "live" and main_s1 is not None and main_s1["live"] == x
        needed = POINT_S["largest" if x == largest else "other"]
        if elapsed + needed > args.budget_s and not reused:
            log(f"curve {name} {curve} {x}: skipped (time budget)")
            results["skipped"].append(
                f"{DEPLOYMENTS[name]} {curve} curve point {x}: skipped, the suite had used "
                f"{elapsed:.0f} s of its {args.budget_s:.0f} s budget (`--budget-s`) and the "
                f"point takes ~{needed:.0f} s"
            )
            continue
        workload = live_point(x) if curve == "live" else state_point(state_count, x)
        if reused:
            # S1 is this point (same episodes, same deployment, loaded through the SDK).
            assert main_s1 is not None
            point = {k: v for k, v in main_s1.items() if isinstance(v, dict)}
            point.update(live=x, state_bytes=0, from_workload="S1")
            baseline = results["baselines"].get("S1", {}).get("stop_the_world")
            if baseline:
                point["stop_the_world"] = baseline
        else:
            log(f"curve {name}: {workload.count} live rollouts, {workload.state_bytes} B states")
            restores = counts["largest_restores" if x == largest else "restores"]
            point = asyncio.run(curve_point(deployment, workload, counts["checkpoints"], restores))
            if not args.no_baselines:  # a before/after of rolloutlog's points needs none
                if (curve, x) not in stw:
                    stw[(curve, x)] = stw_point(workload, counts["stop_the_world"])
                point["stop_the_world"] = stw[(curve, x)]
        mine["live_rollouts" if curve == "live" else "state_bytes"][str(x)] = point
        log(
            f"  {name} {curve} {x}: checkpoint {point['checkpoint_s']['median'] * 1e3:.0f} ms, "
            f"restore {point['restore_s']['median'] * 1e3:.0f} ms (+fetch "
            f"{point['restore_and_fetch_s']['median'] * 1e3:.0f} ms; preload "
            f"{point.get('preload_s', 0):.0f} s)"
        )
    return out
