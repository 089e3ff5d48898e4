"""Plots and ``benchmarks/RESULTS.md`` from ``benchmarks/results/suite.json``.

    python benchmarks/report.py [--quick]

With ``--quick`` it reads ``suite_quick.json`` and writes ``results/RESULTS_quick.md`` and
``*_quick.png`` (not committed). Generated: edit this script, not RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import orjson
from _common import DEPLOYMENTS, RESULTS, ROOT

#: The cause of each missed target, one entry per target: updated by hand after the final
#: ``make bench`` (then ``report.py`` runs again). Each says only what the figures the report prints
#: beside it (the split of the measured time, the service's stage timings) or a named profile
#: support; an empty string prints "not analysed for this run".
CAUSES = {
    "checkpoint_vs_stop_the_world": (
        "the baseline is a lower bound of the seed's design: its episodes park at once (the "
        "seed's policy prepare stage alone took 2 s), all its participants live in one process "
        "and write one record file each to a local disk; rolloutlog's checkpoint is a request to a "
        "service (markers into every partition, the projector's fold up to them, two catalog "
        "transactions, whose stages are listed beside it), and the rest of its time is the HTTP "
        "request and reply (uvicorn, FastAPI, httpx) on the same 2 cores. On Kafka + PostgreSQL "
        "the catalog's commit stage is the largest: its statements are asyncpg round trips, each "
        "waiting for the event loop's next turn (on SQLite the checkpoint's two transactions run "
        "whole on one worker thread, docs/design.md; no synchronous PostgreSQL driver is "
        "installed to do the same)."
    ),
    "restore_and_fetch_over_floor": (
        "the floor only reads and splits the records. A restore takes each continued episode's "
        "verdict from the projector's trackers, which keep no payloads, so its projections are "
        "built by replaying the checkpoint's records and folding them once the plan commits; "
        "then every projection line crosses HTTP and is decoded by the client, on the same 2 "
        "cores. Profiled (py-spy, S1 embedded): the fetch is bound by the service's one core, "
        "~1.7 s of its CPU against the client's 0.55 s (orjson.loads, ~30 µs a line); of the "
        "service's build the fold takes ~75% (the metadata peek ~15 µs per episode, the fold's "
        "state machine ~15, the projection ~10) and encoding the lines ~17% (~11 µs per "
        "episode). Split again with benchmarks/restore_fetch.py --profile (commit 6187bc6, per "
        "S1 restore + fetch of 2.85 s service CPU under load): plan ~0.4 s on the event loop and "
        "~0.3 s in the catalog's thread, the log read ~0.9 s (the floor's own work), the fold "
        "~1.3 s, the line encoding ~0.3 s; the client's decoding alone (~0.45 s) is about the "
        "floor's whole time, so 1.5x the floor leaves the plan and the build almost nothing. "
        "S2's 350 MB of lines are bound by moving bytes on both sides (copies into "
        "fresh memory, ~180 µs per 350 KB here, and httpx's 64 KB reads in the client, ~0.6 s "
        "of its CPU per restore beside ~0.25 s decoding: more than reading and decoding the "
        "same states from files takes)."
    ),
    "restore_and_fetch_vs_stop_the_world_restore": (
        "the stop-the-world restore reads and decodes one file per participant in process; "
        "restore + fetch plans the restore in the service (the verdicts from the trackers, the "
        "catalog commit of every episode's entry, an attempt.started record per continued "
        "episode: the plan's stages are listed with the figures), then folds the replayed records "
        "into projections and streams them over HTTP (the split in the row above)."
    ),
    "restore_and_fetch_vs_eventsourcing": (
        "pyeventsourcing reads one snapshot row per episode in process; restore + fetch streams "
        "every projection over HTTP as NDJSON (large session states cross a socket and are parsed "
        "in the client). On Kafka + PostgreSQL, S2's floor alone (reading its 350 MB of records "
        "back from Tansu) takes most of pyeventsourcing's whole reconstruction."
    ),
    "S4.checkpoint_over_S1": (
        "the saturating appender is a process on the same 2 cores and its HTTP appends share "
        "the service's event loop with the checkpoint's request, whose projector must first fold "
        "them. The stages under S4 are listed beside S1's: on embedded the begin and commit "
        "stages still wait for the catalog's write turn and for the loop between the one-hop "
        "transactions, and the markers are an append queued in the log's commit-group queue "
        "behind the appends' groups and their fsyncs; the rest is the request's own queueing "
        "behind the appends' requests."
    ),
    "restore_peak_rss_mb": (
        "the service holds every live episode's tracker (about 3.7 KB per S1 episode, ~60 MB of "
        "RSS for 16,000: benchmarks/projector_fold.py, commit 4c4b760), and a restore + fetch "
        "adds the restore's encoded projection lines (about 5.4 KB per S1 projection, ~90 MB: "
        "the cache the fetches are served from) and the replay's pages and projection objects "
        "while the lines are built (~40 MB, freed after), over the interpreter and its libraries "
        "(~90 MB idle); the peak grows with live rollouts. On Kafka it also grew with the "
        "restores taken (386 MB over S1's 2 restores + fetches, 428 MB over 5, commit b832812): "
        "a Kafka read's 4 MB Fetch pages moved glibc's mmap threshold up, so from the second "
        "restore on they came from the heap and stayed; `rolloutlog serve` fixes the threshold "
        "at 1 MB (rolloutlog/_malloc.py; the RSS after each of 4 fetches 381, 381, 406, 431 MB "
        "before, 339, 330, 338, 342 MB after, benchmarks/restore_fetch.py, commit dfd50c0). "
        "The RSS after each fetch of this run is listed above."
    ),
    "appends": (
        "service CPU per event on one event loop: the HTTP stack (the events route is served "
        "past FastAPI's per-request machinery), parsing and the envelope check, the projector "
        "folding the appended events (~4 µs) and the log's writer thread (~3.6 µs: SQLite's WAL "
        "writes), with the 8 clients on the same 2 cores; 50,000 events/s needs about 20 µs."
    ),
    "fold_rate": (
        "about 8 µs of CPU per record in one Python process (in process: decoding 1.1 µs, the "
        "record check 0.7 µs, the tracker 2.9 µs with the sha256 lineage checks the rules ask "
        "for, the projector's bookkeeping ~1.3 µs; Kafka adds ~2 µs, mostly the event loop and "
        "the Fetch round trips, the CRC being aiokafka's C code at 0.36 µs; "
        "benchmarks/projector_fold.py, commit 4c4b760), with Tansu on the same 2 cores; "
        "200,000 events/s needs 5 µs including the read: no step measured above 0.5 µs is left "
        "to take out without rewriting the fold in C."
    ),
    "curve_flatness": (
        "a live checkpoint writes what changed since the previous one (delta manifests, the "
        "trainer client's staging keys composed and listed only when read, the entries' "
        "versions laid over the base's); on embedded the catalog's commit follows the size of "
        "the checkpoint's tables (SQLite pages), and the time outside the service's stages is "
        "the HTTP request and reply."
    ),
}
#: Line style of each deployment in the plots (the figure gives the colour).
STYLES = {"embedded": "-", "kafka": "--"}


def ms(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value * 1e3:,.0f} ms" if value < 10 else f"{value:,.1f} s"


def spread(figure: dict[str, float] | None) -> str:
    if not figure:
        return "n/a"
    return f"{ms(figure['median'])} ({ms(figure['min'])}-{ms(figure['max'])})"


def times(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:.2f}x" if value < 10 else f"{value:.0f}x"


def median(figure: dict[str, Any] | None) -> float | None:
    return figure["median"] if figure else None


def _stages(workload: dict[str, Any]) -> str:
    """A workload's checkpoint stage timings (median ms), as the service reported them."""
    stages = (workload.get("stages_ms") or {}).get("checkpoint") or {}
    return ", ".join(f"{k} {v:,.0f}" for k, v in stages.items()) or "not recorded"


def numeric_order(points: dict[str, Any]) -> dict[str, Any]:
    """Curve points by their x (the JSON keeps keys sorted as strings)."""
    return dict(sorted(points.items(), key=lambda item: int(item[0])))


def plot(results: dict[str, Any], suffix: str) -> list[str]:
    """One plot per curve, every deployment's points on it (line style by deployment)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    curves = results.get("curves") or {}
    for key, label, unit in (
        ("live_rollouts", "live rollouts", 1.0),
        ("state_bytes", "session state size", 1024.0),
    ):
        series = {
            name: numeric_order(per.get(key) or {}) for name, per in curves.items() if per.get(key)
        }
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(8, 6.5), dpi=110)
        ticks: set[float] = set()
        for name, points in series.items():
            xs = [int(x) / unit for x in points]
            ticks.update(xs)
            for index, (figure, label_) in enumerate(
                (
                    ("checkpoint_s", "checkpoint (live)"),
                    ("checkpoint_cold_s", "first (cold) checkpoint"),
                    ("restore_s", "restore (plan)"),
                    ("restore_and_fetch_s", "restore + fetch"),
                    ("floor_s", "floor (read + split)"),
                )
            ):
                mine = [
                    (x, p[figure]) for x, p in zip(xs, points.values(), strict=True) if figure in p
                ]
                if not mine:
                    continue
                ax.errorbar(
                    [x for x, _ in mine],
                    [f["median"] for _, f in mine],
                    yerr=[
                        [f["median"] - f["min"] for _, f in mine],
                        [f["max"] - f["median"] for _, f in mine],
                    ],
                    fmt="o" + STYLES.get(name, "-."),
                    color=f"C{index}",
                    markersize=3,
                    capsize=2,
                    label=f"{label_}, {DEPLOYMENTS.get(name, name)}",
                )
        # The stop-the-world baseline does not depend on the deployment: one line.
        stw: dict[float, float] = {}
        for points in series.values():
            for x, p in points.items():
                if p.get("stop_the_world"):
                    stw[int(x) / unit] = p["stop_the_world"]["checkpoint_s"]["median"]
        if stw:
            xs_stw = sorted(stw)
            ax.plot(
                xs_stw,
                [stw[x] for x in xs_stw],
                "^-.",
                color="C5",
                label="stop-the-world checkpoint (lower bound)",
            )
        xs = sorted(ticks)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(xs)
        if key == "state_bytes":
            ax.set_xticklabels([f"{x:g} KB" if x < 1024 else f"{x / 1024:g} MB" for x in xs])
        else:
            ax.set_xticklabels([f"{x:g}" if x < 1000 else f"{x / 1000:g}k" for x in xs])
        ax.minorticks_off()
        ax.set_xlabel(label)
        ax.set_ylabel("seconds (median, bars: min-max)")
        rollouts = {per.get("state_rollouts") for per in curves.values()}
        count = (
            f", {rollouts.pop()} rollouts" if key == "state_bytes" and len(rollouts) == 1 else ""
        )
        lines = {"-": "solid", "--": "dashed"}
        names = "; ".join(
            f"{DEPLOYMENTS.get(name, name)}: {lines.get(STYLES.get(name, ''), 'dash-dot')}"
            for name in series
        )
        ax.set_title(
            f"Checkpoint and restore vs {label}{count}\n({names})",
            fontsize=10,
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13))
        fig.tight_layout()
        name = f"curve_{key}{suffix}.png"
        fig.savefig(RESULTS / name)
        plt.close(fig)
        made.append(name)
    return made


def seed_figures(seed: dict[str, Any]) -> str:
    """The seed system's published figures, as the suite keeps them (``suite.SEED``)."""
    return "\n".join(
        f"> - {key}: "
        + ", ".join(f"{name} {value} s" for name, value in figures.items() if name != "note")
        + f" ({figures.get('note', '')})"
        for key, figures in seed.items()
    )


def churn_rollouts(results: dict[str, Any]) -> str:
    """How many rollouts advance between two measured checkpoints (as the suite recorded it)."""
    for per in results.get("deployments", {}).values():
        for figures in per.values():
            churn = figures.get("churn") if isinstance(figures, dict) else None
            if churn:
                return f"{churn['rollouts_per_checkpoint']:,}"
    return "a fixed number of"


def curve_span(points: dict[str, Any]) -> str:
    xs = sorted(int(x) for x in points)
    return f"{xs[0]:,} → {xs[-1]:,}" if xs else ""


#: How each ``CAUSES`` key is named in the report.
CAUSE_LABELS = {
    "checkpoint_vs_stop_the_world": "S1 checkpoint against stop-the-world",
    "restore_and_fetch_over_floor": "restore + fetch against the floor",
    "restore_and_fetch_vs_stop_the_world_restore": "restore + fetch against the stop-the-world restore",
    "restore_and_fetch_vs_eventsourcing": "restore + fetch against pyeventsourcing",
    "S4.checkpoint_over_S1": "checkpoint under saturating appends",
    "restore_peak_rss_mb": "memory",
    "appends": "HTTP append",
    "fold_rate": "projector fold rate",
    "curve_flatness": "flatness",
}


def measured_split(reason: str, results: dict[str, Any]) -> str:
    """What the suite measured about a missed target, split into its parts (from the JSON only)."""
    deployments = results.get("deployments", {})
    baselines = results.get("baselines", {})
    parts: list[str] = []
    for name, per in deployments.items():
        where = DEPLOYMENTS.get(name, name)
        for key in ("S1", "S2"):
            f = per.get(key) or {}
            if reason.startswith("restore_and_fetch") and "restore_and_fetch_s" in f:
                restore, total = median(f["restore_s"]), median(f["restore_and_fetch_s"])
                assert restore is not None and total is not None
                split = (
                    f"{key} on {where}: restore (plan) {ms(restore)} + fetch {ms(total - restore)}"
                    f" = {ms(total)}"
                )
                base = baselines.get(key, {})
                if reason.endswith("over_floor"):
                    split += f", floor {ms(median(f.get('floor_s')))}"
                elif reason.endswith("stop_the_world_restore") and base.get("stop_the_world"):
                    split += f", stop-the-world restore {ms(median(base['stop_the_world']['restore_s']))}"
                elif reason.endswith("eventsourcing") and base.get("eventsourcing"):
                    split += (
                        f", pyeventsourcing {ms(median(base['eventsourcing']['reconstruct_s']))}"
                    )
                parts.append(split)
        s1 = per.get("S1") or {}
        if reason == "checkpoint_vs_stop_the_world" and s1:
            parts.append(
                f"S1 on {where}: checkpoint {ms(median(s1['checkpoint_s']))} (service stages, "
                f"median ms: {_stages(s1)})"
            )
        s4 = per.get("S4")
        if reason == "S4.checkpoint_over_S1" and s4 and s1:
            parts.append(
                f"{where}: {ms(median(s4['checkpoint_s']))} against S1's "
                f"{ms(median(s1['checkpoint_s']))} while the SDK appended "
                f"{s4['appends']['events_per_s']:,.0f} events/s (service stages, median ms: "
                f"S4 {_stages(s4)}; S1 {_stages(s1)})"
            )
        if reason == "restore_peak_rss_mb" and "restore_peak_rss_mb" in s1:
            parts.append(
                f"{where}: {s1['restore_peak_rss_mb']:,.0f} MB from the first restore to the last "
                f"fetch; {s1['service_peak_rss_mb']:,.0f} MB over the service's whole life (load, "
                "checkpoints, restores, S4)"
                + (
                    "; its RSS after each fetch, in order: "
                    + ", ".join(f"{mb:,.0f}" for mb in s1["rss_after_fetch_mb"])
                    + " MB"
                    if s1.get("rss_after_fetch_mb")
                    else ""
                )
            )
    if reason == "curve_flatness":
        for name, per in (results.get("curves") or {}).items():
            points = numeric_order(per.get("live_rollouts") or {})
            if points:
                parts.append(
                    f"checkpoint (live) on {DEPLOYMENTS.get(name, name)}: "
                    + ", ".join(
                        f"{int(x):,} → {ms(median(p.get('checkpoint_s')))}"
                        for x, p in points.items()
                    )
                )
    appends = results.get("appends") or {}
    if reason == "appends" and appends:
        parts.append(
            f"{median(appends['events_per_s']):,.0f} events/s closed loop, p99 "
            f"{median(appends['half_load_p99_ms']):.0f} ms at half load (p50 "
            f"{median(appends['half_load_p50_ms']):.0f} ms); service CPU "
            f"{median(appends['cpu_us_per_event']):.0f} µs per event"
        )
    fold = results.get("fold_rate") or {}
    if reason == "fold_rate" and fold:
        parts.append(
            f"{median(fold['events_per_s']):,.0f} events/s: {fold['records']:,} records of "
            f"{fold['live']:,} live episodes folded from Kafka by a fresh projector in "
            f"{ms(median(fold['catch_up_s']))} ({fold['events_per_s']['runs']} runs)"
        )
    return "; ".join(parts) + "." if parts else ""


def build(results: dict[str, Any], images: list[str], quick: bool) -> str:
    machine = results["machine"]
    versions = results.get("versions", {})
    deployments = results.get("deployments", {})
    baselines = results.get("baselines", {})
    ratios = results.get("ratios", {})
    targets = results.get("targets", {})
    runs = results.get("runs")
    out: list[str] = []
    w = out.append
    w("# Benchmark results")
    w("")
    w(
        "_Generated by `benchmarks/report.py` from `benchmarks/results/suite"
        + ("_quick" if quick else "")
        + ".json` (`make bench`); do not edit by hand._"
    )
    if quick:
        w("")
        w(
            "**Quick run (`make bench-quick`): small sizes, 2 runs — a smoke test, not the figures.**"
        )
    w("")
    w("## Machine and versions")
    w("")
    w("| | |")
    w("|---|---|")
    w(f"| date | {machine.get('date')} |")
    w(f"| commit | {machine.get('commit')} |")
    w(f"| CPU | {machine.get('cpu')}, {machine.get('cores')} cores |")
    w(f"| platform | {machine.get('platform')} |")
    w(
        f"| load average after the run | {', '.join(f'{x:.1f}' for x in results.get('load_average_after', []))} |"
    )
    parts = ", ".join(
        f"{part} {sec:.0f} s" for part, sec in results.get("part_seconds", {}).items()
    )
    w(
        f"| suite wall time | {results.get('elapsed_s', 0):.0f} s"
        + (f" ({parts})" if parts else "")
        + " |"
    )
    for name, version in versions.items():
        w(f"| {name} | {version} |")
    w("")
    w(
        "The machine is shared (2 cores, other jobs running): timings are noisy and CPU-starved; "
        "compare the systems against each other (same run, same machine) rather than the absolute "
        "figures against other machines."
    )
    w("")
    w("## How it was measured")
    w("")
    w(
        f"Each figure is the median of {runs} runs, with min-max. rolloutlog runs as a real "
        "`rolloutlog serve` subprocess (a fresh one per workload): the workload is appended through "
        "the participant SDK (`HttpTransport` on the embedded deployment, `KafkaTransport` on Kafka + "
        "PostgreSQL, with `validate=False`: the workloads' envelopes are checked by "
        "`tests/test_benchmarks.py`), the benchmark waits until the projector holds every live "
        "episode, then "
        "checkpoints and restores go over REST with `rolloutlog.trainer.AsyncTrainerClient`. "
        "**Checkpoint** = request → committed reply, measured as it happens in a live run: the "
        "service has committed a checkpoint before, and between two measured checkpoints "
        f"{churn_rollouts(results)} live rollouts each append one more event through the SDK "
        "(a new state of their exported session; a boundary in S3) and the projector folds it "
        "(untimed). The same number at every size: a checkpoint should cost what changed since "
        "the previous one, not what is live. **First (cold) checkpoint** = the first one a fresh "
        "service takes (its whole manifest is written), reported beside it. Restores come after "
        "the live checkpoints (a restore gives every continued episode a new attempt: the "
        "checkpoint after it changes every entry, reported as *after a restore* in the JSON). "
        "**Restore** = request → committed plan; "
        "**restore + fetch** = until every continued episode's projection has been streamed "
        "(`GET …/restores/{id}/projections`, NDJSON, each line decoded). CPU seconds and peak RSS "
        "(VmHWM) of the service process come from `/proc`."
    )
    w("")
    w(
        "- **S1**: 16,000 live rollouts x 10 events (episode.started, a resources session, two ledger "
        "rows of 512 token ids with a session state and a boundary each, a step in flight with a "
        "64-token generation chunk). **S2**: 1,000 live rollouts each with one 350 KB session state. "
        "**S3**: 15,686 live rollouts with three-row ledgers (256 ids per row) plus 2,000 finished ones "
        "the restore must skip. **S4**: S1's service while a separate process appends through the SDK "
        "as fast as the service acknowledges (4 transports, closed loop, batches of 100 small "
        "boundaries) — checkpoints taken during it."
    )
    w(
        "- **Stop-the-world export** (the seed's design, reduced to its core): pause admission, every "
        "live episode parks (asyncio tasks that park at once — the real wait for in-flight steps is "
        "not counted, so this is a *lower bound*), every participant serializes its live state (JSON) "
        "to a record file named by digest and fsyncs it (concurrently), manifest written and fsynced "
        "last, resume. Its restore reads and decodes those files."
    )
    w(
        "- **pyeventsourcing** (`eventsourcing`, SQLite persistence): one aggregate per episode, one "
        "aggregate event per envelope, snapshots every 4 events; *reconstruct* = `repository.get` "
        "of every live episode from a fresh application."
    )
    w(
        "- **Floor**: reading the records a restore of that checkpoint replays from rolloutlog's own "
        "log and splitting them (metadata decoded, opaque states passed through), nothing else."
    )
    curve_runs = next((c.get("runs") for c in (results.get("curves") or {}).values()), None)
    if curve_runs:
        w(
            "- **Curves** (on "
            + " and ".join(DEPLOYMENTS.get(d, d) for d in results["curves"])
            + "): each point's episodes (S1's, or S2's with another state size) are preloaded in "
            "bulk straight into the deployment's log (the embedded log, or the run's Kafka topics) "
            "with `rolloutlog.log` while the service is stopped, then the restarted service "
            "catches up and is measured over REST like the workloads. To keep the suite within "
            f"~15 minutes a point takes fewer runs: {curve_runs['checkpoints']} live checkpoints, "
            f"{curve_runs['restores']} restores ({curve_runs['largest_restores']} at the largest "
            f"live-rollouts point), {curve_runs['stop_the_world']} stop-the-world checkpoints (one "
            "series shared by the deployments); the 16,000 live-rollouts point is S1's measurement "
            f"({runs} runs). The curve tables give each point's run counts."
        )
    appends = results.get("appends") or {}
    if appends:
        w(
            "- **HTTP append** (`benchmarks/api_append.py`, run by the suite): per run a fresh "
            "`rolloutlog serve` on the embedded log with its default options; "
            f"{appends.get('clients')} clients each on its own keep-alive connection POST batches "
            f"of {appends.get('batch')} ~250-byte events as fast as the service acknowledges "
            f"(closed loop, {appends.get('seconds_per_phase'):g} s) → events/s; then the same "
            "clients paced at half that rate (open loop) → p50/p99 request latency, counted from "
            f"when each request was due. Median of {appends.get('runs')} run(s)."
        )
    w("")

    # -- targets
    w("## Targets")
    w("")
    w("| target | " + " | ".join(DEPLOYMENTS[d] for d in deployments) + " |")
    w("|---|" + "---|" * len(deployments))
    missed: list[str] = []
    #: The ``CAUSES`` keys of the missed targets, in the order they were missed.
    reasons: list[str] = []

    def row(
        label: str,
        getter: Any,
        target: float,
        higher_is_better: bool,
        fmt: Any,
        why: str = "",
        informative: bool = False,
    ) -> None:
        cells = []
        for name, per in deployments.items():
            value = getter(name, per)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                cells.append("n/a")
                continue
            met = value >= target if higher_is_better else value <= target
            cells.append(f"{fmt(value)} {'✅' if met else '❌'}")
            if not met and not informative:
                by = value / target if not higher_is_better else target / value
                missed.append(
                    f"{label} on {DEPLOYMENTS[name]}: measured {fmt(value)} (missed by {by:.1f}x)"
                )
                if why and why not in reasons:
                    reasons.append(why)
        w(f"| {label} | " + " | ".join(cells) + " |")

    def fig(workload: str, key: str) -> Any:
        return lambda name, per: median(per.get(workload, {}).get(key))

    def rat(key: str) -> Any:
        return lambda name, per: ratios.get(name, {}).get(key)

    # The targets (suite.TARGETS), a row each.
    row(
        "S1 checkpoint ≥ 20x faster than stop-the-world (live: a checkpoint after the previous one)",
        rat("S1.checkpoint_vs_stop_the_world"),
        targets["S1.checkpoint_vs_stop_the_world"],
        True,
        times,
        "checkpoint_vs_stop_the_world",
    )
    row(
        "S1 first (cold) checkpoint vs stop-the-world (informative: the whole manifest)",
        rat("S1.cold_checkpoint_vs_stop_the_world"),
        targets["S1.checkpoint_vs_stop_the_world"],
        True,
        times,
        informative=True,
    )
    for key in ("S1", "S2"):
        row(
            f"{key} restore + fetch within 1.5x of the read floor",
            fig(key, "restore_and_fetch_over_floor"),
            targets["restore_and_fetch_over_floor"],
            False,
            times,
            "restore_and_fetch_over_floor",
        )
    for key in ("S1", "S2"):
        row(
            f"{key} restore + fetch faster than the stop-the-world restore",
            rat(f"{key}.restore_and_fetch_vs_stop_the_world_restore"),
            1.0,
            True,
            times,
            "restore_and_fetch_vs_stop_the_world_restore",
        )
        row(
            f"{key} restore + fetch faster than pyeventsourcing's reconstruction",
            rat(f"{key}.restore_and_fetch_vs_eventsourcing"),
            1.0,
            True,
            times,
            "restore_and_fetch_vs_eventsourcing",
        )
    row(
        "S4 checkpoint under saturating appends within 2x of S1's",
        rat("S4.checkpoint_over_S1"),
        targets["S4.checkpoint_over_S1"],
        False,
        times,
        "S4.checkpoint_over_S1",
    )
    row(
        "service peak RSS, S1 restore + fetch ≤ 400 MB",
        lambda name, per: per.get("S1", {}).get("restore_peak_rss_mb"),
        targets["S1.restore_peak_rss_mb"],
        False,
        lambda mb: f"{mb:,.0f} MB",
        "restore_peak_rss_mb",
    )
    seed = results.get("seed", {})
    for key, figure in (
        ("S1", "checkpoint_s"),
        ("S2", "checkpoint_s"),
        ("S1", "restore_s"),
        ("S2", "restore_s"),
        ("S3", "restore_s"),
    ):
        published = seed.get(key, {}).get(figure)
        if published:
            row(
                f"{key} {figure.split('_')[0]} faster than the seed's published {published} s "
                "(informative: another machine)",
                lambda name, per, k=key, f=figure, p=published: (
                    p / median(per[k][f]) if per.get(k, {}).get(f) else None
                ),
                1.0,
                True,
                times,
                informative=True,
            )
    # Figures of one deployment each (other parts of the suite: ``appends``, ``fold_rate``).
    appends = results.get("appends") or {}
    fold = results.get("fold_rate") or {}
    single = [
        (
            "HTTP append, one service, batches of 100, 8 clients ≥ 50k events/s (embedded)",
            median(appends.get("events_per_s")),
            targets["appends.events_per_s"],
            True,
            lambda v: f"{v:,.0f} events/s",
            "appends",
        ),
        (
            "HTTP append p99 at half load ≤ 25 ms (embedded)",
            median(appends.get("half_load_p99_ms")),
            targets["appends.p99_half_load_ms"],
            False,
            lambda v: f"{v:.0f} ms",
            "appends",
        ),
        (
            "projector fold rate on Kafka ≥ 200k events/s",
            median(fold.get("events_per_s")),
            targets["fold_rate.events_per_s"],
            True,
            lambda v: f"{v:,.0f} events/s",
            "fold_rate",
        ),
    ]
    w("")
    w("| target (one deployment) | measured |")
    w("|---|---|")
    for label, value, target, higher, fmt, why in single:
        if value is None:
            w(f"| {label} | not measured in this run |")
            continue
        met = value >= target if higher else value <= target
        w(f"| {label} | {fmt(value)} {'✅' if met else '❌'} |")
        if not met:
            by = target / value if higher else value / target
            missed.append(f"{label}: measured {fmt(value)} (missed by {by:.1f}x)")
            if why not in reasons:
                reasons.append(why)
    flatness = ratios.get("curves", {})
    curves = results.get("curves") or {}
    if flatness:
        names = list(flatness)
        w("")
        w(
            "| flatness (max/min of the medians over the curve; the span in brackets) | "
            + " | ".join(DEPLOYMENTS.get(n, n) for n in names)
            + " |"
        )
        w("|---|" + "---|" * len(names))
        for key, label, target in (
            ("live_rollouts.checkpoint_s", "checkpoint (live) vs live rollouts within 2x", True),
            (
                "live_rollouts.checkpoint_cold_s",
                "first (cold) checkpoint vs live rollouts (informative)",
                False,
            ),
            ("state_bytes.checkpoint_s", "checkpoint (live) vs state size within 2x", True),
            ("live_rollouts.restore_s", "restore vs live rollouts (informative)", False),
            ("state_bytes.restore_s", "restore vs state size (informative)", False),
        ):
            cells = []
            for name in names:
                value = flatness[name].get(f"{key}.max_over_min")
                if value is None:
                    cells.append("n/a")
                    continue
                span = curve_span(curves.get(name, {}).get(key.split(".")[0]) or {})
                if not target:
                    cells.append(f"{times(value)} ({span})")
                    continue
                met = value <= targets["curve_flatness"]
                cells.append(f"{times(value)} {'✅' if met else '❌'} ({span})")
                if not met:
                    missed.append(
                        f"{label} on {DEPLOYMENTS.get(name, name)} ({span}): measured "
                        f"{value:.2f}x (missed by {value / targets['curve_flatness']:.1f}x)"
                    )
                    if "curve_flatness" not in reasons:
                        reasons.append("curve_flatness")
            w(f"| {label} | " + " | ".join(cells) + " |")
    w("")
    w("### Missed targets")
    w("")
    if missed:
        for item in missed:
            w(f"- {item}")
    else:
        w("- none")
    w("")
    if reasons:
        w(
            "Why: per target, the split of what was measured (from the figures below), then the "
            "cause as analysed (`CAUSES` in `benchmarks/report.py`):"
        )
        w("")
        for reason in reasons:
            facts = measured_split(reason, results)
            cause = CAUSES.get(reason) or "not analysed for this run."
            w(
                f"- **{CAUSE_LABELS[reason]}**: "
                + (f"{facts} " if facts else "")
                + f"Cause: {cause}"
            )
        w("")

    # -- figures
    w("## Figures")
    w("")
    for name, per in deployments.items():
        w(f"### rolloutlog, {DEPLOYMENTS[name]}")
        w("")
        w(
            "| workload | checkpoint (live) | first (cold) checkpoint | restore (plan) | "
            "restore + fetch | floor | restore / floor | load (SDK) | "
            "service CPU per checkpoint / restore+fetch | service peak RSS: whole life / "
            "restores + fetches |"
        )
        w("|---|---|---|---|---|---|---|---|---|---|")
        for key in ("S1", "S2", "S3"):
            f = per.get(key)
            if not f:
                continue
            w(
                f"| {key} ({f['live']:,} live) | {spread(f['checkpoint_s'])} | "
                f"{spread(f.get('checkpoint_cold_s'))} | {spread(f.get('restore_s'))} | "
                f"{spread(f.get('restore_and_fetch_s'))} | {spread(f.get('floor_s'))} | "
                f"{times(median(f.get('restore_over_floor')))} | "
                f"{f['load_events_per_s']:,.0f} events/s | "
                f"{f['service_cpu_s_per_checkpoint']:.2f} s / {f['service_cpu_s_per_restore_and_fetch']:.2f} s | "
                f"{f['service_peak_rss_mb']:,.0f} MB / "
                + (f"{f['restore_peak_rss_mb']:,.0f} MB" if "restore_peak_rss_mb" in f else "n/a")
                + " |"
            )
        for key in ("S1", "S2", "S3"):
            stages = (per.get(key) or {}).get("stages_ms") or {}
            parts = [
                f"{kind} " + ", ".join(f"{stage} {value:,.0f}" for stage, value in values.items())
                for kind, values in stages.items()
                if values
            ]
            if parts:
                w("")
                w(f"{key}, the service's own stage timings (median ms): " + "; ".join(parts) + ".")
        kinds = [
            f"{key} {spread(f['restore_and_fetch_per_kind_s'])} ({f['per_kind_lines']:,} lines; "
            f"the single stream {spread(f['restore_and_fetch_s'])}, {f['live']:,} lines)"
            for key in ("S1", "S2", "S3")
            for f in [per.get(key) or {}]
            if "restore_and_fetch_per_kind_s" in f
        ]
        if kinds:
            w("")
            w(
                "Restore + fetch with one fetcher per participant kind in parallel (environment, "
                "policy, resources, agent; each stream holds what its kind restores), beside the "
                "single stream the targets are measured on: " + "; ".join(kinds) + "."
            )
        s4 = per.get("S4")
        if s4:
            a = s4["appends"]
            w("")
            w(
                f"S4 (S1 + saturating appends): checkpoint {spread(s4['checkpoint_s'])} "
                f"({times(ratios.get(name, {}).get('S4.checkpoint_over_S1'))} S1's) while the SDK "
                f"appended {a['events_per_s']:,.0f} events/s ({a['writers']} transports, batches of "
                f"{a['batch']}; append latency p50 {a['p50_ms']:.0f} ms, p99 {a['p99_ms']:.0f} ms, "
                f"max {a['max_ms']:.0f} ms); service CPU during the checkpoints "
                f"{s4['service_cpu_s_during']:.1f} s; the service's own stage timings (median "
                f"ms): {_stages(s4)}."
            )
        w("")
    w("### Baselines (same run, same envelopes)")
    w("")
    w(
        "| workload | stop-the-world checkpoint (lower bound) | of which export + fsync | "
        "stop-the-world restore (read + decode files) | pyeventsourcing reconstruct | "
        "pyeventsourcing store (setup) |"
    )
    w("|---|---|---|---|---|---|")
    for key, base in baselines.items():
        stw = base.get("stop_the_world", {})
        es = base.get("eventsourcing", {})
        w(
            f"| {key} | {spread(stw.get('checkpoint_s'))} | {spread(stw.get('export_s'))} | "
            f"{spread(stw.get('restore_s'))} | {spread(es.get('reconstruct_s'))} | "
            f"{ms(es.get('store_s'))} |"
        )
    w("")
    w("### Ratios to the baselines (medians, same run)")
    w("")
    w("| ratio | " + " | ".join(DEPLOYMENTS[d] for d in deployments) + " |")
    w("|---|" + "---|" * len(deployments))
    keys = sorted({k for d in deployments for k in ratios.get(d, {})})
    for key in keys:
        w(f"| {key} | " + " | ".join(times(ratios.get(d, {}).get(key)) for d in deployments) + " |")
    w("")
    w(
        "`checkpoint_vs_stop_the_world` (the live checkpoint), `cold_checkpoint_vs_stop_the_world`, "
        "`restore_and_fetch_vs_stop_the_world_restore` and `restore_and_fetch_vs_eventsourcing`: "
        "how many times faster rolloutlog is; `restore_over_floor`: rolloutlog's restore (plan) over the floor's time; "
        "`S4.checkpoint_over_S1`: S4's checkpoint over S1's."
    )
    w("")

    # -- curves
    curves = results.get("curves") or {}
    if curves:
        w("## Curves")
        w("")
        for name, per in curves.items():
            for key, label, unit in (
                ("live_rollouts", "live rollouts", ""),
                ("state_bytes", f"state size ({per.get('state_rollouts')} rollouts)", " B"),
            ):
                points = numeric_order(per.get(key) or {})
                if not points:
                    continue
                w(f"{DEPLOYMENTS.get(name, name)}, against {label}:")
                w("")
                w(
                    f"| {label} | checkpoint (live) | first (cold) checkpoint | restore (plan) | "
                    "restore + fetch | floor | stop-the-world checkpoint | runs (checkpoint / "
                    "restore / stop-the-world) |"
                )
                w("|---|---|---|---|---|---|---|---|")
                for x, p in points.items():
                    stw = (p.get("stop_the_world") or {}).get("checkpoint_s")
                    counts = " / ".join(
                        str((f or {}).get("runs", "-"))
                        for f in (p.get("checkpoint_s"), p.get("restore_s"), stw)
                    )
                    w(
                        f"| {int(x):,}{unit}"
                        + (f" ({p['from_workload']})" if p.get("from_workload") else "")
                        + f" | {spread(p['checkpoint_s'])} | "
                        f"{spread(p.get('checkpoint_cold_s'))} | {spread(p['restore_s'])} | "
                        f"{spread(p['restore_and_fetch_s'])} | {spread(p['floor_s'])} | "
                        f"{spread(stw)} | {counts} |"
                    )
                w("")
        for image in images:
            w(f"![{image}](results/{image})")
            w("")
        w(
            "A point marked (S1) is S1's measurement on that deployment (loaded through the SDK); "
            "the others were preloaded in bulk. The first (cold) checkpoint is one run per point."
        )
        w("")

    # -- the seed
    for item in results.get("skipped", []):
        w(f"- {item}")
    if results.get("skipped"):
        w("")
    w("## The seed's published figures (the reference)")
    w("")
    w(seed_figures(results.get("seed", {})))
    w("")
    w(
        "The seed measured a whole Gym (its checkpoint includes parking real participants); the "
        "stop-the-world baseline above is that design's core on this machine, without the parking wait."
    )
    w("")
    w("## Known limits of these measurements")
    w("")
    w(
        "- Tansu stands in for Kafka: no idempotent producer (appends use `acks=all` without it), and "
        "it keeps topics in memory; Apache Kafka would differ in both directions."
    )
    w(
        "- Medians of one figure move between runs on this machine with the other jobs' load "
        "(up to 2-3x for the 16,000-episode checkpoint): compare the systems within one run."
    )
    w(
        "- The load generators, the trainer client and the baselines run on the same 2 cores as the "
        "service; S4's appender is a separate process competing for them."
    )
    w(
        "- pyeventsourcing stores every event with its own JSON transcoding into SQLite; its *store* "
        "time is setup, not compared; its reconstruction is compared with rolloutlog's restore + fetch."
    )
    w("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    suffix = "_quick" if args.quick else ""
    results = orjson.loads((RESULTS / f"suite{suffix}.json").read_bytes())
    images = plot(results, suffix)
    target = RESULTS / "RESULTS_quick.md" if args.quick else ROOT / "benchmarks" / "RESULTS.md"
    text = build(results, images, args.quick)
    if args.quick:
        text = text.replace("](results/", "](")
    Path(target).write_text(text)
    print(f"wrote {target} and {', '.join(images) or 'no plots'}")


if __name__ == "__main__":
    main()
