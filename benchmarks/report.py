"""Plots and ``benchmarks/RESULTS.md`` from ``benchmarks/results/suite.json``.

    python benchmarks/report.py [--quick]

With ``--quick`` it reads ``suite_quick.json`` and writes ``results/RESULTS_quick.md`` and
``*_quick.png`` (not committed). Generated: edit this script or its parts, not RESULTS.md. This
script holds the causes of missed targets (``CAUSES``, by hand) and puts the report together from
``report_tables.py`` (the header, how it was measured, the figures, the curves, the seed and the
limits), ``report_targets.py`` (the targets, met or missed, and what was measured about each
missed one), ``report_plots.py`` (the curves' plots) and ``report_format.py`` (how a figure is
written).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson
from _common import RESULTS, ROOT
from report_plots import plot
from report_tables import closing, curves, figures, introduction
from report_targets import measured_split, target_rows

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
        "two stages make the difference with embedded. The catalog's commit: about 12 "
        "statements and a COPY, each an asyncpg round trip, 6-9 ms alone against an idle "
        "PostgreSQL (measured with SQLAlchemy's cursor events), more in the service, where each "
        "waits for the event loop's next turn (on SQLite the checkpoint's two transactions run "
        "whole on one worker thread, docs/design.md; no synchronous PostgreSQL driver is "
        "installed to do the same). And the projector's stage: Tansu holds a Fetch for its "
        "whole wait when the records it asks for were not yet there as it began, so markers "
        "acknowledged while the projector's Fetch at the end is out (10 ms, and one poll in ten "
        "the 500 ms recheck of rolloutlog/log/_kafka_reads.py) reach it 10-14 ms later instead "
        "of 2-3; over 15-20 checkpoints the stage took 2.6-17 ms (median 5.4-6.4), and 3.5-3.9 "
        "ms with a 2 ms wait everywhere, which is not used: a shorter wait makes Tansu's short "
        "answers under load more frequent (the module's docstring). Apache Kafka answers a "
        "Fetch as soon as the records are there. The ratio moves with the baseline and with the "
        "live checkpoint itself: 17x in the run before this one on this machine (29 ms against "
        "506 ms), 19.5x in this one (26 ms against 508 ms)."
    ),
    "restore_and_fetch_over_floor": (
        "S1 meets it on both deployments. S2 meets it on Kafka + PostgreSQL and cannot on "
        "embedded, by any fetch through a socket: the floor reads S2's 360 MB of records as "
        "the restore's composition does, its large records as views of their blob files' "
        'mappings (docs/design.md "A large state is read in place"), so no byte of them is '
        "copied, while a fetch must carry every byte through a socket to the participant; the "
        "socket floor, those bytes through a loopback socket and nothing else (no HTTP, no "
        "lines, no decoding, no plan), is already above 1.5x the floor (its figures are in the "
        "split). Nor is it the floor's reading in place that decides it: read with copies, as "
        "the projector reads, the same records took 106-117 ms on this machine "
        "(benchmarks/baselines.py's floor with read_pages, 4 runs), and S2's restore + fetch is "
        "1.75-1.93x that. The rest of S2's restore + fetch is the plan and the client's splitting and "
        "decoding of every line as NDJSON (orjson alone decodes S2's lines in ~170 ms on this "
        "machine, measured in one process without a socket); the service's side is small: the "
        "checkpoint's lines are prepared, each large state a view of a mapped file "
        '(docs/design.md "A prepared large state is kept mapped, not on the heap"), ~0.13 s of '
        "its CPU a restore + fetch. On Kafka + PostgreSQL the floor reads the records back "
        "from Tansu (~0.5 s) while the restore reads none of them: the prepare did, off the "
        "checkpoint's path."
    ),
    "restore_and_fetch_vs_stop_the_world_restore": (
        "the stop-the-world restore is one process reading its files and decoding its states "
        "with orjson (C), while restore + fetch is a plan in Python (its stages are listed with "
        "the figures) and then a client decoding states much like the baseline's, so the ratio "
        "moves with how fast the machine runs pure-Python code: the committed runs on a machine "
        "that ran a loop of 20M additions in 3.0 s measured S1 at 0.96x and 0.97x, those on one "
        "that ran it in 1.3 s at 1.61x and 1.47x, and this run's machine ran it in 0.95 s. S2 "
        "is bound by the client's reading and decoding of its 360 MB stream (see the floor)."
    ),
    "restore_and_fetch_vs_eventsourcing": (
        "pyeventsourcing reads one snapshot row per episode in process; restore + fetch streams "
        "every projection over HTTP as NDJSON (large session states cross a socket and are "
        "parsed in the client). S2 on Kafka + PostgreSQL, the one that missed it before, meets "
        'it since a prepare keeps the large states in files of their own (docs/design.md "A '
        'prepared large state is kept mapped, not on the heap"): its restore + fetch took '
        "1,305-1,808 ms in the runs that read the states back from Tansu after the plan."
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
        "writes), with the 8 clients on the same 2 cores; 50,000 events/s needs about 20 µs. "
        "The figure follows how fast the machine runs pure-Python code: 47,900-51,167 events/s "
        "at ~20 µs on a machine that ran a loop of 20M additions in 1.3 s, 21,757 events/s at "
        "37 µs on one that ran it in 3.0 s, with nothing changed on the append path."
    ),
    "fold_rate": (
        "CPU per record, in one Python process with Tansu on the same 2 cores: "
        "benchmarks/projector_fold.py on this machine (its latest run is in "
        "benchmarks/results/projector_fold.json) gives 5.0-5.8 µs a record for the projector's "
        "`_take` in process (decoding the metadata, peek_record, 1.1-1.3 µs; the record check "
        "0.7-0.8 µs; the fold's state machine, EpisodeTracker.observe, 2.5-3.0 µs; the "
        "projector's bookkeeping the rest) and 6.0-7.4 µs of CPU a record for a catch-up "
        "through Kafka (the record batches' parsing and the Fetches on top), 128-159k records/s "
        "of wall time. A catch-up opens the next partition's Fetch while it folds the current "
        "one and folds each page with the collector paused (commit abf84bb: +25% events/s). "
        "200,000 events/s needs 5 µs a record including the read: the fold's state machine and "
        "the metadata's decoding alone take about 4 µs in Python. The figure follows the "
        "machine: 63k events/s on one that ran a loop of 20M additions in 3.0 s, 78-106k at "
        "1.3 s, 126-138k on this one (0.95 s)."
    ),
    "curve_flatness": (
        "a live checkpoint writes what changed since the previous one (delta manifests, the "
        "trainer client's staging keys composed and listed only when read, the entries' "
        "versions laid over the base's); on embedded the catalog's commit follows the size of "
        "the checkpoint's tables (SQLite pages), and the time outside the service's stages is "
        "the HTTP request and reply."
    ),
}


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


def build(results: dict[str, Any], images: list[str], quick: bool) -> str:
    """RESULTS.md's text: the sections in order, the missed targets with their causes."""
    out = introduction(results, quick)
    lines, missed, reasons = target_rows(results)
    out += lines
    w = out.append
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

    out += figures(results)
    out += curves(results, images)
    out += closing(results)
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
