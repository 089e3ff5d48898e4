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
        "the catalog's commit stage is the largest: its statements are asyncpg round trips, each "
        "waiting for the event loop's next turn (on SQLite the checkpoint's two transactions run "
        "whole on one worker thread, docs/design.md; no synchronous PostgreSQL driver is "
        "installed to do the same). The ratio also moves with the baseline: its export writes "
        "and fsyncs the record files, 400-760 ms across the committed runs; and on Kafka + "
        "PostgreSQL with the live checkpoint itself, whose every stage took longer in some "
        "runs than in others with nothing changed on its path (the service's total 34, 43 and "
        "39 ms over the three runs before this one, the catalog's commit 16 ms in each: 14x, "
        "12x, 14x; 39 ms and 17 ms in this one: 17x)."
    ),
    "restore_and_fetch_over_floor": (
        "S1: the plan (its stages are listed with the figures) replies once the plan is "
        "committed, before the projector takes the restore's resets (they come while the lines "
        "prepared at the checkpoint stream, docs/design.md §10 step 9), and the fetch is the "
        "client's decoding: fetching a committed restore's 16,000 lines took 645-741 ms on this "
        "run's machine, 607-738 ms of it the client's CPU (38-46 µs an S1 line, ~20 µs on the "
        "earlier runs' Xeon). On Kafka + PostgreSQL the ratio moves with the floor, reading "
        "S1's records back from Tansu: 898 ms in this run, 1,137 ms in the run before it on "
        "this machine and code (1.30x there). S2 meets it on Kafka + PostgreSQL and cannot on "
        "embedded. The floor reads its 350 MB of records as the restore's composition does and "
        "decodes only their metadata (on embedded the large records are views of their blob "
        'files\' mappings, docs/design.md "A large state is read in place": no byte of them is '
        "copied, ~60-120 ms), while a fetch carries them through a socket into a client that "
        "decodes every line: the client's reading and decoding of S2's stream alone took "
        "497-558 ms of its CPU on this machine (~160-190 ms of it orjson), several times the "
        "floor. The service's side is small: the checkpoint's lines are prepared, each large "
        'state a view of a mapped file (docs/design.md "A prepared large state is kept mapped, '
        'not on the heap"), ~0.3 s of its CPU and ~400-600 page faults a restore + fetch. On '
        "Kafka + PostgreSQL the floor reads the records back from Tansu (~1 s) while the "
        "restore reads none of them: the prepare did, off the checkpoint's path (~1.5 s of "
        "the service's CPU, ~3 s after the commit), and keeps them in files of their own, so "
        "restore + fetch takes ~0.6 s (1.7 s before: aiokafka's copies, ~113k page faults)."
    ),
    "restore_and_fetch_vs_stop_the_world_restore": (
        "this run's machine is an AMD EPYC that runs pure-Python code about 2.3x slower than "
        "the Xeon of the earlier runs (a loop of 20M additions: 3.0 s against 1.3 s) and C "
        "code at about the same speed: the stop-the-world restore, one process reading its "
        "files and decoding its states with orjson, took 1,454 ms for S1 against 1,409 ms in "
        "the run before, while S1's restore + fetch (a plan in Python, 564 ms, then the client "
        "decoding states much like the baseline's) took 1,518 ms against 873. So S1 is at "
        "0.96x and 0.97x here, against 1.61x and 1.47x in the run before. The code did not "
        "slow down: the previous code and this one, alternated on this machine "
        "(benchmarks/restore_fetch.py, S1 embedded, 3 runs each, two pairs), took 1,571 and "
        "1,393 ms against 1,312 and 1,111 ms. S2 on embedded meets it in this run (1.09x: 518 against 565 ms; 0.83x in "
        "the run before) and is bound by the client: httpx's HTTP/1.1 path copies each byte of "
        "the stream three more times (h11's receive buffer, in and out, then httpcore's "
        "bytes); a reader that receives into one reused buffer took 257-337 ms of client CPU "
        "for S2's stream against httpx's 497-558 ms (4 alternated pairs on this machine; not "
        "built: it would be a hand-made HTTP client); for S1's stream the two took the same "
        "(the decoding dominates). On Kafka + PostgreSQL S2 is 0.88x (640 against 565 ms; 0.28x before the "
        "prepare kept its states in files): the restore reads nothing from Tansu, and the rest "
        "is the client's side, as on embedded, and the plan on PostgreSQL."
    ),
    "restore_and_fetch_vs_eventsourcing": (
        "pyeventsourcing reads one snapshot row per episode in process; restore + fetch streams "
        "every projection over HTTP as NDJSON (large session states cross a socket and are "
        "parsed in the client). S2 on Kafka + PostgreSQL, the one that missed it before, meets "
        'it since a prepare keeps the large states in files of their own (docs/design.md "A '
        'prepared large state is kept mapped, not on the heap"): its restore + fetch took '
        "1,305, 1,808 and 1,689 ms over the three runs before this one, which read the states "
        "back from Tansu after the plan, and 640 ms in this one."
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
        "The earlier runs measured 47,900-51,167 events/s at ~20 µs, then 29,860 and 37,228 "
        "events/s at 23-32 µs on a slower machine (there, alternated, the code before those "
        "runs measured 31,160-38,192 events/s and theirs 34,146-41,411). This run's "
        "machine, an AMD EPYC, runs pure-Python code about 2.3x slower than the earlier runs' "
        "Xeon (a loop of 20M additions: 3.0 s against 1.3 s): 37 µs of service CPU per event. "
        "Nothing on the append path changed since."
    ),
    "fold_rate": (
        "about 13 µs of CPU per record on either log (Kafka 12.7, embedded 13.1 µs: "
        "benchmarks/projector_fold.py on this machine, other runs beside it), in one Python "
        "process with Tansu on the same 2 cores. Split (py-spy, the projector's task): the "
        "fold's state machine ~45% (EpisodeFold.observe alone ~5.3 µs a record in process), "
        "decoding the metadata ~16% (~1.9 µs), the record check ~13% (~1.2 µs), the Kafka "
        "record batches' parsing ~6% (0.83 µs, of which the CRC-32C 0.43 before google-crc32c "
        "took it over, ~0.07 since), the projector's "
        "bookkeeping the rest. A catch-up now opens the next partition's Fetch while it folds the "
        "current one and folds each page with the collector paused (before, ~0.64 s of a 2.7 s "
        "catch-up waited for first pages and 0.3-0.6 s went to collections: +25% events/s, "
        "commit abf84bb). 200,000 events/s needs 5 µs including the read: the state machine "
        "alone takes about that in Python. (This run's machine runs pure-Python code about 2.3x "
        "slower than the earlier runs' Xeon: 63k events/s against 78-106k.)"
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
