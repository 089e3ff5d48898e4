"""Restore + fetch of one or more workloads on one deployment, beside the baselines it is judged
against, measured in the same run: the suite's own measurement (the service, load and
``checkpoints_and_restores`` of ``suite_workload.measure_workload``) without the rest of the suite
(no S4, no curves, no pyeventsourcing).

Per workload: restore (plan) and restore + fetch (the single stream, each line decoded, as the
suite measures it), the floor, the stop-the-world restore (read + decode its files), their
ratios; the service's CPU per restore + fetch and this process's (the client's) CPU during the
fetches; the live checkpoint (so that a change to the restore path shows what it costs the
checkpoint). With ``--fetchers kind``, restore + fetch again with one fetcher per participant
kind in parallel (each its own stream, as real Gyms fetch), labelled apart.

With ``--profile DIR`` the service runs under ``py-spy record`` (CPU samples, ``--idle`` off)
from the end of the load to the last fetch, and its flame graph is saved in DIR (speedscope
JSON) beside the client's cProfile of the same span.

    python benchmarks/restore_fetch.py [--workloads S1,S2] [--backend embedded] [--runs 3]
        [--profile DIR] [--fetchers kind] [--save-as NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import suite_service
import suite_workload
from _common import kafka_broker, save, summary
from baselines import stop_the_world_checkpoint, stop_the_world_restore
from workloads import Workload, live_states, s1, s2, s3

from rolloutlog.trainer import AsyncTrainerClient


@contextlib.contextmanager
def py_spy(pid: int, out: Path | None) -> Iterator[None]:
    """``py-spy record`` of ``pid`` (CPU samples only) while the block runs, saved to ``out``
    (speedscope JSON); nothing without ``out`` or without py-spy installed."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if out is None or not Path(exe).exists():
        yield
        return
    command = [exe, "record", "--pid", str(pid), "--format", "speedscope", "--rate", "250"]
    proc = subprocess.Popen(
        [*command, "--output", str(out), "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # attached
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


async def measure(
    deployment: suite_service.Deployment,
    workload: Workload,
    runs: int,
    profile: Path | None,
    per_kind: bool,
) -> dict[str, Any]:
    with suite_service.service(deployment) as svc:
        run = f"{workload.name.lower()}-{uuid.uuid4().hex[:6]}"
        async with AsyncTrainerClient(svc.url) as trainer:
            await trainer.create_run(run, suite_service.PARTITIONS)
            await trainer.take_over(run)
            episodes, load_s = await suite_service.sdk_load(svc, run, workload)
            await suite_service.caught_up(trainer, run, workload.live)
            spy = profile / f"{workload.name}-{deployment.name}-service.json" if profile else None
            client_profile = cProfile.Profile() if profile else None
            cpu0 = time.process_time()
            with py_spy(svc.proc.pid if svc.proc else 0, spy):
                if client_profile:
                    client_profile.enable()
                out = await suite_workload.checkpoints_and_restores(
                    svc, trainer, run, workload, runs, runs, per_kind=runs if per_kind else 0
                )
                if client_profile:
                    client_profile.disable()
                    client_profile.dump_stats(
                        str(profile / f"{workload.name}-{deployment.name}-client.prof")
                    )
            out["client_cpu_s_checkpoints_and_restores"] = time.process_time() - cpu0
            out["load_s"] = load_s
            out["service_peak_rss_mb"] = svc.peak_rss_mb()
    states = live_states(episodes)
    del episodes
    gc.collect()
    directory = Path(tempfile.mkdtemp(prefix="rolloutlog-stw-"))
    try:
        restores = []
        for index in range(runs):
            target = directory / str(index)
            await stop_the_world_checkpoint(states, target)
            seconds, restored = stop_the_world_restore(target)
            assert restored == workload.live
            restores.append(seconds)
            shutil.rmtree(target)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out["stop_the_world_restore_s"] = summary(restores)
    stw = out["stop_the_world_restore_s"]["median"]
    out["restore_and_fetch_vs_stop_the_world_restore"] = stw / out["restore_and_fetch_s"]["median"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="S1,S2")
    parser.add_argument("--backend", default="embedded", choices=("embedded", "kafka"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--fetchers", choices=("single", "kind"), default="single")
    parser.add_argument("--save-as", default="restore_fetch")
    args = parser.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    made = {"S1": s1, "S2": s2, "S3": s3}
    results: dict[str, Any] = {"runs": args.runs, "backend": args.backend, "workloads": {}}
    with kafka_broker(args.backend == "kafka") as kafka:
        for name in args.workloads.split(","):
            deployment = suite_service.Deployment(args.backend, kafka)
            figures = asyncio.run(
                measure(deployment, made[name](), args.runs, args.profile, args.fetchers == "kind")
            )
            results["workloads"][name] = figures
            line = (
                f"{name} {args.backend}: restore {figures['restore_s']['median'] * 1e3:.0f} ms, "
                f"+fetch {figures['restore_and_fetch_s']['median'] * 1e3:.0f} ms, floor "
                f"{figures['floor_s']['median'] * 1e3:.0f} ms "
                f"(x{figures['restore_and_fetch_over_floor']['median']:.2f}), stop-the-world "
                f"restore {figures['stop_the_world_restore_s']['median'] * 1e3:.0f} ms "
                f"(x{figures['restore_and_fetch_vs_stop_the_world_restore']:.2f} faster); "
                f"checkpoint {figures['checkpoint_s']['median'] * 1e3:.0f} ms; service CPU "
                f"{figures['service_cpu_s_per_restore_and_fetch']:.2f} s and "
                f"{figures['service_page_faults_per_restore_and_fetch']:,} page faults per "
                "restore+fetch; "
                f"RSS {figures['restore_peak_rss_mb']:.0f} MB (after each fetch {figures['rss_after_fetch_mb']}); stages {figures['stages_ms']['restore']}"
            )
            if "restore_and_fetch_per_kind_s" in figures:
                line += (
                    f"; per-kind fetchers "
                    f"{figures['restore_and_fetch_per_kind_s']['median'] * 1e3:.0f} ms"
                )
            print(line, flush=True)
    print(f"saved {save(args.save_as, results)}")


if __name__ == "__main__":
    main()
