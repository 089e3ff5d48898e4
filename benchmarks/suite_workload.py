"""One workload on one deployment: a fresh service loaded through the SDK, then checkpoints as
they happen in a live run (rollouts moving on between them), floors, restores and their fetches
(one stream, and one fetcher per participant kind), and for S1 the checkpoints of S4 on the same
service (``suite_appends.saturated_checkpoints``).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from _common import log, summary
from baselines import floor, socket_floor
from suite_appends import saturated_checkpoints
from suite_service import (
    PARTITIONS,
    Deployment,
    Service,
    caught_up,
    prepared,
    reader,
    sdk_load,
    service,
    transport,
)
from workloads import SHARDS, Workload

from rolloutlog.trainer import AsyncTrainerClient

#: Restores fetched by one fetcher per participant kind, per workload (after the single
#: stream's; the suite's time budget allows one).
PER_KIND_RUNS = 1


#: How many live rollouts move on by one event between two measured checkpoints: the same
#: count at every size, so the live-rollouts curve shows what a checkpoint costs per live
#: rollout when what changed stays the same.
CHURN_ROLLOUTS = 200


@contextlib.asynccontextmanager
async def advancing(
    svc: Service, run: str, workload: Workload
) -> AsyncIterator[Callable[[int], Awaitable[int]]]:
    """Yields a function that appends one round of ``workload.advance`` through the SDK (its
    participants registered again, with their new epochs) and lets the projector fold it."""
    kinds = {kind for _, kind in workload.participants()} & {"resources", "environment"}
    kind = "environment" if workload.name == "S3" else "resources"
    assert kind in kinds
    async with transport(svc) as t:
        epochs = {shard: await t.register(run, f"{kind}-{shard}", kind) for shard in range(SHARDS)}
        assert len(set(epochs.values())) == 1, epochs  # every shard registered as often

        async def advance(round_: int) -> int:
            events = workload.advance(round_, CHURN_ROLLOUTS, epochs[0])
            await t.append(run, events)
            await asyncio.sleep(0.3)  # folded by then: a live run's projector keeps up
            return len(events)

        yield advance


async def checkpoints_and_restores(
    svc: Service,
    trainer: AsyncTrainerClient,
    run: str,
    workload: Workload,
    runs: int,
    restores: int,
    per_kind: int = 0,
) -> dict[str, Any]:
    """Checkpoints as they happen in a live run, then restores.

    1. The first (cold) checkpoint of the service: its projector has no earlier one, so the
       whole manifest is written (``checkpoint_cold_s``).
    2. ``runs`` rounds of: ``CHURN_ROLLOUTS`` live rollouts advance (untimed), then a checkpoint
       (request → committed: ``checkpoint_s``).
    3. ``restores`` rounds of: the wait for the checkpoint's lines to be prepared (the service
       starts that 1 s after the commit, off its path: ``prepare_s`` from the checkpoint's
       reply, ``service_cpu_s_per_prepare``), floor (read + split what a restore of the newest
       checkpoint replays) and the socket floor (its bytes through a loopback socket alone:
       ``baselines.socket_floor``), restore (request → committed plan), fetching every projection of
       it (NDJSON stream, decoded as a participant would); before each round but the first, a
       new checkpoint (every episode changed: the restore gave it a new attempt), whose time
       is ``checkpoint_after_restore_s``.
    4. ``per_kind`` rounds of: a checkpoint, a restore and its fetch by one fetcher per
       participant kind in parallel (``fetch_per_kind``: ``restore_and_fetch_per_kind_s``).
    """
    live = workload.live
    figures: dict[str, list[float]] = {}
    stages: dict[str, dict[str, list[float]]] = {"checkpoint": {}, "restore": {}}
    cpu = {"checkpoint": 0.0, "restore": 0.0, "prepare": 0.0}
    restore_faults = 0

    async def checkpoint(figure: str) -> Any:
        before = svc.cpu_s()
        t0 = time.perf_counter()
        info = await trainer.checkpoint(run)
        figures.setdefault(figure, []).append(time.perf_counter() - t0)
        if figure == "checkpoint_s":
            cpu["checkpoint"] += svc.cpu_s() - before
        assert info.status == "committed", info
        assert info.counts["continue"] >= live, info.counts
        return info

    info = await checkpoint("checkpoint_cold_s")
    cold_stages = dict(info.timings_ms)
    advanced = 0
    async with advancing(svc, run, workload) as advance:
        for index in range(runs):
            advanced += await advance(index)
            info = await checkpoint("checkpoint_s")
            for stage, value in info.timings_ms.items():
                stages["checkpoint"].setdefault(stage, []).append(float(value))
    svc.reset_peak_rss()
    rss_after: list[float] = []
    states: list[str] = []
    for index in range(restores):
        if index:
            info = await checkpoint("checkpoint_after_restore_s")
        # The restore's lines are prepared off the checkpoint's path once it commits: a crash
        # comes between checkpoints, so a restore meets them ready. Waited for here (its time
        # from the checkpoint's reply, ``prepare_s``), before the floor reads the log beside it.
        t0, before = time.perf_counter(), svc.cpu_s()
        states.append(await prepared(svc, run, info.checkpoint_id))
        if index:
            figures.setdefault("prepare_s", []).append(time.perf_counter() - t0)
            cpu["prepare"] += svc.cpu_s() - before
        async with reader(svc) as log:
            floor_s, floor_bytes = await floor(log, run, info.offsets)
        socket_s = socket_floor(floor_bytes)
        before, faults_before = svc.cpu_s(), svc.page_faults()
        t0 = time.perf_counter()
        restored = await trainer.restore(run, checkpoint_id=info.checkpoint_id)
        restore_s = time.perf_counter() - t0
        assert restored.counts["continue"] >= live, restored.counts
        fetched = 0
        async for _ in trainer.projections(run, restored.restore_id):
            fetched += 1
        fetch_s = time.perf_counter() - t0
        cpu["restore"] += svc.cpu_s() - before
        restore_faults += svc.page_faults() - faults_before
        assert fetched == restored.counts["continue"], (fetched, restored.counts)
        for stage, value in restored.timings_ms.items():
            stages["restore"].setdefault(stage, []).append(float(value))
        for key, value in {
            "restore_s": restore_s,
            "restore_and_fetch_s": fetch_s,
            "floor_s": floor_s,
            "restore_over_floor": restore_s / floor_s,
            "restore_and_fetch_over_floor": fetch_s / floor_s,
            "socket_s": socket_s,
            "socket_over_floor": socket_s / floor_s,
        }.items():
            figures.setdefault(key, []).append(value)
        figures.setdefault("floor_mb", []).append(floor_bytes / 1e6)
        rss_after.append(svc.rss_mb())
    out: dict[str, Any] = {key: summary(values) for key, values in figures.items()}
    # The service's peak RSS from the first restore to the last fetch (the checkpoint after a
    # restore included), not the load's.
    out["restore_peak_rss_mb"] = svc.peak_rss_mb()
    # The service's RSS after each restore's fetch, in order: flat, or growing with restores.
    out["rss_after_fetch_mb"] = rss_after
    # What each restore met of its checkpoint's prepare (``ready``, or ``skipped``: its lines
    # would not fit the service's budget, and the restore composes them after its commit).
    out["prepared"] = states
    if per_kind:
        # Beside the single stream: the same restore + fetch with one fetcher per participant
        # kind in parallel, as real Gyms fetch (each kind's stream holds what it restores, so
        # the kinds together receive more lines than the single stream).
        seconds, lines = [], 0
        for _ in range(per_kind):
            info = await trainer.checkpoint(run)
            await prepared(svc, run, info.checkpoint_id)
            t0 = time.perf_counter()
            restored = await trainer.restore(run, checkpoint_id=info.checkpoint_id)
            lines = await fetch_per_kind(trainer, run, restored.restore_id)
            seconds.append(time.perf_counter() - t0)
        out["restore_and_fetch_per_kind_s"] = summary(seconds)
        out["per_kind_lines"] = lines
    out["churn"] = {"rollouts_per_checkpoint": CHURN_ROLLOUTS, "events": advanced}
    # The service's own stage timings (its reply's ``timings_ms``): where the time went.
    out["stages_ms"] = {
        kind: {stage: statistics.median(values) for stage, values in per.items()}
        for kind, per in stages.items()
    }
    out["stages_ms"]["cold_checkpoint"] = cold_stages
    out["service_cpu_s_per_checkpoint"] = cpu["checkpoint"] / runs
    out["service_cpu_s_per_restore_and_fetch"] = cpu["restore"] / max(1, restores)
    out["service_page_faults_per_restore_and_fetch"] = restore_faults // max(1, restores)
    # What preparing a checkpoint's lines cost the service (off the checkpoint's path).
    out["service_cpu_s_per_prepare"] = cpu["prepare"] / max(1, restores - 1)
    return out


#: The participant kinds whose projections a restore serves (``kind=`` of the bulk route).
KINDS = ("environment", "policy", "resources", "agent")


async def fetch_per_kind(trainer: AsyncTrainerClient, run: str, restore_id: int) -> int:
    """A restore's projections fetched by one fetcher per participant kind, in parallel (each
    line decoded); returns the lines received in all."""

    async def one(kind: str) -> int:
        return sum([1 async for _ in trainer.projections(run, restore_id, kind=kind)])

    return sum(await asyncio.gather(*(one(kind) for kind in KINDS)))


async def measure_workload(
    deployment: Deployment, workload: Workload, runs: int, restores: int, saturate: bool
) -> tuple[dict[str, Any], list[list[Any]]]:
    """One workload on a fresh service: SDK load, checkpoints, floors, restores and fetches; with
    ``saturate`` (S1), then S4 on the same service (its churn episodes are new ones, so the
    restores before it do not fence them)."""
    with service(deployment) as svc:
        run = f"{workload.name.lower()}-{uuid.uuid4().hex[:6]}"
        async with AsyncTrainerClient(svc.url) as trainer:
            await trainer.create_run(run, PARTITIONS)
            await trainer.take_over(run)
            cpu0 = svc.cpu_s()
            episodes, load_s = await sdk_load(svc, run, workload)
            try:
                catch_up_s = await caught_up(trainer, run, workload.live)
            except RuntimeError:
                log(f"the service's log (last lines):\n{svc.log_tail()}")
                raise
            load_cpu = svc.cpu_s() - cpu0
            out = await checkpoints_and_restores(
                svc, trainer, run, workload, runs, restores, per_kind=PER_KIND_RUNS
            )
            out.update(
                {
                    "episodes": workload.count,
                    "live": workload.live,
                    "events": sum(len(e) for e in episodes),
                    "load_s": load_s,
                    "load_events_per_s": sum(len(e) for e in episodes) / load_s,
                    "catch_up_s": catch_up_s,
                    "service_cpu_s_load": load_cpu,
                }
            )
            s4_out = None
            if saturate:
                s4_out = await saturated_checkpoints(svc, trainer, run, workload.live, runs, 4)
            out["service_peak_rss_mb"] = svc.peak_rss_mb()
            out["service_cpu_s_total"] = svc.cpu_s()
    if s4_out is not None:
        out["S4"] = s4_out
    return out, episodes
