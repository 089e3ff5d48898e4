"""The benchmark suite: checkpoints and restores at the seed's scale, beside the alternatives.

rolloutlog is measured through the real service: a ``rolloutlog serve`` subprocess per workload,
loaded with the SDK's transports (``HttpTransport`` on the embedded deployment, ``KafkaTransport``
on Kafka (Tansu) + PostgreSQL), checkpointed and restored over REST with ``rolloutlog.trainer``'s
client. Workloads S1-S4 are ``workloads.py``'s; the baselines (stop-the-world export,
pyeventsourcing on SQLite, the floor) are ``baselines.py``'s, on the same envelopes, in the same
run. Curves (both deployments): checkpoint and restore latency against live rollouts and
against state size; their episodes are preloaded straight into the deployment's log with
``rolloutlog.log`` (service stopped), then measured over REST on a restarted service. The HTTP
append figures are ``api_append.py``'s, run by this suite.

Its parts: ``suite_service.py`` (the service and how a workload gets into it),
``suite_workload.py`` (one workload on one deployment), ``suite_appends.py`` (S4's load and the
HTTP append figures), ``suite_curves.py``, ``suite_fold.py`` (the projector's fold rate on Kafka)
and ``baselines.py``'s measurements; this script runs them and computes the ratios.

Saved to ``benchmarks/results/suite.json`` (``suite_quick.json`` with ``--quick``); ``report.py``
turns it into plots and ``benchmarks/RESULTS.md``.

    python benchmarks/suite.py [--quick] [--runs 5] [--backends embedded,kafka]
        [--parts main,appends,curves] [--save-as NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from typing import Any

from _common import kafka_broker, log, save
from baselines import measure_baselines
from suite_appends import APPEND_RUNS, http_appends, saturate
from suite_curves import measure_curves
from suite_fold import fold_rate
from suite_service import POSTGRES, Deployment
from suite_workload import measure_workload
from workloads import s1, s2, s3

#: The targets (``report.py`` prints a row for each).
TARGETS = {
    "S1.checkpoint_vs_stop_the_world": 20.0,
    "curve_flatness": 2.0,
    "restore_and_fetch_over_floor": 1.5,
    "S4.checkpoint_over_S1": 2.0,
    "S1.restore_peak_rss_mb": 400.0,
    # Other parts of the suite (keys ``appends`` and ``fold_rate`` of the results).
    "appends.events_per_s": 50_000.0,
    "appends.p99_half_load_ms": 25.0,
    "fold_rate.events_per_s": 200_000.0,
}


SEED = {
    "S1": {
        "checkpoint_s": 1.43,
        "restore_s": 2.01,
        "note": "16,000 rollouts, two policy workers; "
        "the policy prepare stage took 2 s (25 s before an optimization)",
    },
    "S2": {
        "checkpoint_s": 3.6,
        "restore_s": 3.4,
        "note": "1,000 sessions of 350 KB "
        "(11.5 s / 6.0 s before); JSON encode/decode ~2 ms per 350 KB session",
    },
    "S3": {"restore_s": 1.5, "note": "importing 15,686 episodes' ledgers on restore"},
}


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("rolloutlog", "eventsourcing", "fastapi", "uvicorn", "aiokafka", "sqlalchemy"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    try:
        out["postgresql"] = asyncio.run(_postgres_version())
    except Exception:  # the version is informative only
        out["postgresql"] = "unknown"
    return out


async def _postgres_version() -> str:
    import asyncpg

    conn = await asyncpg.connect(POSTGRES.replace("postgresql+asyncpg", "postgresql"))
    try:
        return str(await conn.fetchval("SHOW server_version"))
    finally:
        await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--backends", default="embedded,kafka")
    parser.add_argument("--parts", default="main,appends,curves")
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 runs (smoke test)")
    parser.add_argument(
        "--no-baselines",
        action="store_true",
        help="rolloutlog's figures only, curve points included (a before/after comparison of "
        "two commits needs no more)",
    )
    parser.add_argument("--workloads", default="S1,S2,S3", help="of the main part")
    parser.add_argument(
        "--save-as",
        help="results/NAME.json instead of suite.json (a partial run must not replace it)",
    )
    parser.add_argument("--saturate", nargs=4, metavar=("URL", "RUN", "SECONDS", "WRITERS"))
    parser.add_argument("--saturate-log")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=930.0,
        help="the suite's wall-time budget: a curve point that would end past it is skipped "
        "(and listed as skipped; default: %(default)s)",
    )
    parser.add_argument(
        "--live-points",
        help="the live-rollouts points of the curves part, comma-separated (default: "
        "1000,4000,16000,64000; empty: none)",
    )
    parser.add_argument(
        "--state-points",
        help="the state-size points (bytes) of the curves part, comma-separated (default: "
        "1024,32768,1048576; empty: none)",
    )
    args = parser.parse_args()
    # Tansu has no idempotent producer: its warning per producer is known (see RESULTS.md).
    for name in ("aiokafka", "rolloutlog.log.kafka"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if args.saturate:
        url, run, seconds, writers = args.saturate
        asyncio.run(saturate(url, run, float(seconds), int(writers), args.saturate_log))
        return
    # A terminated suite still stops what it started (services, the broker): exit through the
    # context managers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    quick = args.quick
    runs = 2 if quick else args.runs
    backends = [b for b in args.backends.split(",") if b]
    parts = args.parts.split(",")
    sizes = (
        {"S1": s1(1000), "S2": s2(100), "S3": s3(1000, 150)}
        if quick
        else {"S1": s1(), "S2": s2(), "S3": s3()}
    )
    sizes = {key: workload for key, workload in sizes.items() if key in args.workloads.split(",")}
    results: dict[str, Any] = {
        "quick": quick,
        "runs": runs,
        "versions": versions(),
        "targets": TARGETS,
        "seed": SEED,
        "deployments": {},
        "baselines": {},
        "curves": {},
        "skipped": [],
        # Wall seconds of each part of this run (where the suite's time goes).
        "part_seconds": {},
    }
    if "kafka" in backends and results["versions"]["postgresql"] == "unknown":
        # A clone without the services still measures the embedded deployment (and says so).
        backends.remove("kafka")
        results["skipped"].append(f"Kafka + PostgreSQL deployment: no PostgreSQL at {POSTGRES}")
        log(results["skipped"][-1])
    with kafka_broker("kafka" in backends and "main" in parts) as kafka:
        part_started = time.perf_counter()
        if "main" in parts:
            for name in backends:
                deployment = Deployment(name, kafka if name == "kafka" else None)
                per: dict[str, Any] = {}
                for key, workload in sizes.items():
                    if quick and name != backends[0] and key != "S1":
                        continue  # quick: the second deployment's S1 (and S4) only
                    log(f"{name} {key}: {workload.count} episodes")
                    figures, episodes = asyncio.run(
                        measure_workload(
                            deployment,
                            workload,
                            runs,
                            runs,
                            saturate=key == "S1",
                        )
                    )
                    s4 = figures.pop("S4", None)
                    per[key] = figures
                    if s4 is not None:
                        per["S4"] = s4
                    log(
                        f"  checkpoint {figures['checkpoint_s']['median'] * 1e3:.0f} ms, restore "
                        f"{figures['restore_s']['median'] * 1e3:.0f} ms (+fetch "
                        f"{figures['restore_and_fetch_s']['median'] * 1e3:.0f} ms), floor "
                        f"{figures['floor_s']['median'] * 1e3:.0f} ms; load {figures['load_s']:.1f} s"
                        + (
                            f"; S4 checkpoint {s4['checkpoint_s']['median'] * 1e3:.0f} ms at "
                            f"{s4['appends']['events_per_s']:.0f} events/s, p99 "
                            f"{s4['appends']['p99_ms']:.0f} ms"
                            if s4
                            else ""
                        )
                    )
                    if name == backends[0] and not args.no_baselines:
                        log(f"  baselines on {key}")
                        results["baselines"][key] = measure_baselines(
                            workload, episodes, runs, runs, eventsourcing=key in ("S1", "S2")
                        )
                        log(f"  {results['baselines'][key]}")
                    del episodes
                results["deployments"][name] = per
            if kafka is not None:
                log("projector fold rate on Kafka (S1's episodes)")
                results["fold_rate"] = asyncio.run(fold_rate(kafka, sizes["S1"], 2 if quick else 3))
                log(f"  {results['fold_rate']['events_per_s']['median']:.0f} events/s")
            results["part_seconds"]["main"] = time.perf_counter() - part_started
    if "appends" in parts:
        log("HTTP append (benchmarks/api_append.py, embedded, the service's defaults)")
        part_started = time.perf_counter()
        results["appends"] = http_appends(APPEND_RUNS["quick" if quick else "full"])
        results["part_seconds"]["appends"] = time.perf_counter() - part_started
        log(
            f"  {results['appends']['events_per_s']['median']:.0f} events/s, p99 at half load "
            f"{results['appends']['half_load_p99_ms']['median']:.1f} ms"
        )
    if "curves" in parts:
        part_started = time.perf_counter()
        with kafka_broker("kafka" in backends) as kafka:
            results["curves"] = measure_curves(results, backends, kafka, quick, started, args)
        results["part_seconds"]["curves"] = time.perf_counter() - part_started
    results["ratios"] = ratios(results)
    results["elapsed_s"] = time.perf_counter() - started
    results["load_average_after"] = os.getloadavg()
    path = save(args.save_as or "suite" + ("_quick" if quick else ""), results)
    log(f"saved {path} ({results['elapsed_s']:.0f} s)")


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Each deployment's medians against the baselines measured in the same run."""
    out: dict[str, Any] = {}
    for name, per in results["deployments"].items():
        mine: dict[str, float] = {}
        for key, figures in per.items():
            base = results["baselines"].get(key, {})
            if key == "S4":
                mine["S4.checkpoint_over_S1"] = ratio(
                    figures["checkpoint_s"]["median"], per["S1"]["checkpoint_s"]["median"]
                )
                continue
            stw = base.get("stop_the_world")
            if stw:
                mine[f"{key}.checkpoint_vs_stop_the_world"] = ratio(
                    stw["checkpoint_s"]["median"], figures["checkpoint_s"]["median"]
                )
                if "checkpoint_cold_s" in figures:
                    mine[f"{key}.cold_checkpoint_vs_stop_the_world"] = ratio(
                        stw["checkpoint_s"]["median"], figures["checkpoint_cold_s"]["median"]
                    )
            if stw and "restore_and_fetch_s" in figures:
                mine[f"{key}.restore_and_fetch_vs_stop_the_world_restore"] = ratio(
                    stw["restore_s"]["median"], figures["restore_and_fetch_s"]["median"]
                )
            es = base.get("eventsourcing")
            if es:
                mine[f"{key}.restore_and_fetch_vs_eventsourcing"] = ratio(
                    es["reconstruct_s"]["median"], figures["restore_and_fetch_s"]["median"]
                )
            mine[f"{key}.restore_over_floor"] = figures["restore_over_floor"]["median"]
        out[name] = mine
    for name, curves in results.get("curves", {}).items():
        for curve in ("live_rollouts", "state_bytes"):
            points = curves.get(curve) or {}
            for key in ("checkpoint_s", "checkpoint_cold_s", "restore_s"):
                medians = [p[key]["median"] for p in points.values() if key in p]
                if len(medians) < 2:
                    continue
                out.setdefault("curves", {}).setdefault(name, {})[f"{curve}.{key}.max_over_min"] = (
                    ratio(max(medians), min(medians))
                )
    return out


if __name__ == "__main__":
    main()
