"""The benchmark pieces at tiny sizes: the workloads are valid envelopes, the baselines
restore what they stored, and the report names the targets a result misses. And the results
directory holds each script's own output only, and nothing tracked is named after a work branch."""

from __future__ import annotations

import asyncio
import copy
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from rolloutlog.log import (
    encode_record,
    encode_record_dict,
    record_episode,
    split_record,
    validate_event,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import baselines
import report
import workloads

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def test_workloads_are_valid_and_deterministic() -> None:
    for workload in (workloads.s1(5), workloads.s2(3, 2048), workloads.s3(8, 2)):
        episodes = list(workload.episodes())
        assert episodes == list(workload.episodes())
        assert len(episodes) == workload.count
        for events in episodes:
            for event in events:
                validate_event(event)
        live = workloads.live_states(episodes)
        assert len({e for per in live.values() for e in per}) == workload.live
    first = workloads.s1(1).episodes().__next__()
    assert len(first) == 10
    rows = [e["data"] for e in first if e["type"] == "ledger.row"]
    assert rows[1]["digest"] == workloads.ledger_digest(rows[0]["digest"], rows[1]["token_ids"])


def test_workload_records_are_the_ones_the_sdk_writes() -> None:
    """The benchmarks append plain dicts without validation (``KafkaTransport(validate=False)``,
    bulk preloads): their keys must come in the envelope model's order, or their records differ
    from every SDK participant's and miss the record peeks' fast paths (``record_episode``)."""
    workload = workloads.s1(3)
    events = [event for episode in workload.episodes() for event in episode]
    events += workload.advance(0, 2, 1) + workloads.s3(2, 1).advance(1, 2, 1)
    events += workloads.churn_batch(0, 1, 1, 60)
    events += [e for episode in workloads.s2(2, 512).episodes() for e in episode]
    for event in events:
        record = encode_record_dict(copy.deepcopy(event))
        model = encode_record(validate_event(event))
        assert list(split_record(record)[0]) == list(split_record(model)[0]), event["type"]
        assert record.startswith(b'{"v":1,"episode":"')
        assert record_episode(record) == event["episode"]


def test_baselines_restore_what_they_stored(tmp_path: Path) -> None:
    workload = workloads.s3(6, 2)
    episodes = list(workload.episodes())
    figures = asyncio.run(
        baselines.stop_the_world_checkpoint(workloads.live_states(episodes), tmp_path / "stw")
    )
    assert figures["bytes"] > 0 and (tmp_path / "stw" / "MANIFEST.json").exists()
    assert baselines.stop_the_world_restore(tmp_path / "stw")[1] == workload.live


def test_eventsourcing_baseline_reconstructs_the_live_episodes(tmp_path: Path) -> None:
    pytest.importorskip("eventsourcing", reason="the `bench` extra is not installed")
    workload = workloads.s3(6, 2)
    episodes = list(workload.episodes())
    _, live = baselines.eventsourcing_store(tmp_path / "es.sqlite3", episodes)
    assert len(live) == workload.live
    assert baselines.eventsourcing_reconstruct(tmp_path / "es.sqlite3", live) > 0


def _figure(value: float) -> dict[str, float]:
    return {"median": value, "min": value, "max": value, "runs": 5}


def test_report_names_missed_targets() -> None:
    import suite

    per = {
        "live": 16_000,
        "checkpoint_s": _figure(0.05),
        "checkpoint_cold_s": _figure(0.5),
        "restore_s": _figure(0.8),
        "restore_and_fetch_s": _figure(1.0),
        "floor_s": _figure(0.4),
        "restore_over_floor": _figure(2.0),
        "restore_and_fetch_over_floor": _figure(2.5),
        "floor_mb": _figure(120.0),
        "socket_s": _figure(0.032),
        "socket_over_floor": _figure(0.08),
        "load_events_per_s": 1000.0,
        "service_cpu_s_per_checkpoint": 0.1,
        "service_cpu_s_per_restore_and_fetch": 1.0,
        "service_peak_rss_mb": 600.0,
        "restore_peak_rss_mb": 500.0,
        "churn": {"rollouts_per_checkpoint": 200, "events": 1000},
    }
    results = {
        "machine": {"date": "today", "cpu": "x", "cores": 2},
        "runs": 5,
        "targets": suite.TARGETS,
        "deployments": {"embedded": {"S1": per}},
        "baselines": {},
        "ratios": {"embedded": {"S1.checkpoint_vs_stop_the_world": 25.0}},
        "fold_rate": {
            "records": 160_000,
            "live": 16_000,
            "catch_up_s": _figure(160_000 / 150_000.0),
            "events_per_s": _figure(150_000.0),
        },
    }
    text = report.build(results, [], quick=False)
    missed = text.split("### Missed targets", 1)[1].split("##", 1)[0]
    assert "S1 restore + fetch within 1.5x of the read floor on embedded: measured 2.50x" in missed
    # The floor's split names what its bytes alone take through a socket.
    assert (
        "floor 400 ms (its 120 MB through a loopback socket alone: 32 ms, 0.08x the floor)" in text
    )
    assert "service peak RSS, S1 restore + fetch ≤ 400 MB on embedded: measured 500 MB" in missed
    assert "projector fold rate on Kafka ≥ 200k events/s: measured 150,000 events/s" in missed
    assert "stop-the-world" not in missed  # 25x: met
    assert "200 live rollouts each append one more event" in text
    assert (
        "HTTP append, one service, batches of 100, 8 clients ≥ 50k events/s (embedded) | not "
        in text
    )


def test_report_covers_both_deployments_curves_and_the_http_append() -> None:
    import suite
    import suite_curves

    def point(checkpoint: float) -> dict[str, dict[str, float]]:
        return {
            "checkpoint_s": _figure(checkpoint),
            "checkpoint_cold_s": _figure(0.3),
            "restore_s": _figure(0.5),
            "restore_and_fetch_s": _figure(1.0),
            "floor_s": _figure(0.4),
        }

    def curves(largest: float) -> dict[str, object]:
        return {
            "live_rollouts": {"1000": point(0.03), "64000": point(largest)},
            "state_bytes": {"1024": point(0.03), "1048576": point(0.04)},
            "state_rollouts": 200,
            "runs": suite_curves.CURVE_RUNS,
        }

    results = {
        "machine": {"date": "today", "cpu": "x", "cores": 2},
        "runs": 5,
        "targets": suite.TARGETS,
        "deployments": {},
        "baselines": {},
        "curves": {"embedded": curves(0.09), "kafka": curves(0.05)},
        "appends": {
            "events_per_s": _figure(12_000.0),
            "half_load_p50_ms": _figure(9.0),
            "half_load_p99_ms": _figure(40.0),
            "cpu_us_per_event": _figure(60.0),
            "runs": 3,
            "seconds_per_phase": 5.0,
            "batch": 100,
            "clients": 8,
        },
    }
    results["ratios"] = suite.ratios(results)
    text = report.build(results, [], quick=False)
    missed = text.split("### Missed targets", 1)[1].split("## Figures", 1)[0]
    assert (
        "checkpoint (live) vs live rollouts within 2x on embedded (1,000 → 64,000): measured 3.00x"
        in missed
    )
    assert "on Kafka (Tansu) + PostgreSQL (1,000 → 64,000)" not in missed  # 1.67x: met
    assert (
        "HTTP append, one service, batches of 100, 8 clients ≥ 50k events/s (embedded): " in missed
    )
    assert "HTTP append p99 at half load ≤ 25 ms (embedded): measured 40 ms" in missed
    assert "12,000 events/s closed loop, p99 40 ms at half load" in missed  # the measured split
    assert "Kafka (Tansu) + PostgreSQL, against live rollouts:" in text
    assert "| 64,000 | 50 ms (50 ms-50 ms) |" in text
    assert set(report.CAUSES) == set(report.CAUSE_LABELS)


def test_live_churn_advances_live_episodes_with_valid_events() -> None:
    for workload in (workloads.s1(40), workloads.s2(10, 256), workloads.s3(30, 10)):
        live = {events[0]["episode"] for events in workload.episodes()}
        if workload.name == "S3":
            live = {f"lin{i}" for i in workload.live_indexes()}
        for round_ in range(2):
            events = workload.advance(round_, 8, epoch=2)
            assert len(events) == 8 and len({e["episode"] for e in events}) == 8
            for event in events:
                validate_event(event)
                assert event["episode"] in live


@pytest.mark.kafka
@pytest.mark.slow
def test_fold_rate_folds_every_record_from_kafka(kafka_bootstrap: str) -> None:
    import suite

    figures = asyncio.run(suite.fold_rate(kafka_bootstrap, workloads.s1(50), 1))
    assert figures["records"] == 500 and figures["live"] == 50
    assert figures["events_per_s"]["median"] > 0


#: How a work branch names things (letters, a two-digit number from 10 to 19, maybe a letter, then
#: an underscore): what the repository holds is named after what it is, never after its making.
WORK_BRANCH = re.compile(r"\b[a-z]+1[0-9][a-z]?_")


def _tracked(*paths: str) -> list[str]:
    """The files git tracks (under ``paths``), relative to the repository's root."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", *paths], cwd=ROOT, capture_output=True, check=True
        )
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"not a git checkout, so the tracked files are unknown: {error}")
    return [name for name in listed.stdout.decode().split("\0") if name]


def test_results_hold_each_scripts_own_output_only() -> None:
    """benchmarks/results/ holds ``<script>.json`` (as ``_common.save`` labels it) for scripts of
    benchmarks/ and report.py's ``curve_*.png`` plots; a run saved under another name (a
    comparison, ``--save-as``) belongs in a commit message."""
    scripts = {path.stem for path in BENCHMARKS.glob("*.py")}
    strays = []
    for name in _tracked("benchmarks/results"):
        path = ROOT / name
        if path.suffix == ".png" and re.fullmatch(r"curve_[a-z_]+", path.stem):
            continue
        own = path.suffix == ".json" and path.stem in scripts
        if own and orjson.loads(path.read_bytes()).get("benchmark") == path.stem:
            continue
        strays.append(name)
    assert not strays, f"not a script's own latest run: {strays}"


def test_nothing_tracked_names_a_work_branch() -> None:
    named = []
    for name in _tracked():
        if WORK_BRANCH.search(name):
            named.append(name)
            continue
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):  # removed from the checkout, or not text
            continue
        named += [
            f"{name}:{number}"
            for number, line in enumerate(text.splitlines(), 1)
            if WORK_BRANCH.search(line)
        ]
    assert not named, f"named after a work branch: {named}"
