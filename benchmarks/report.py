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
        "39 ms over the last three runs, the catalog's commit 16 ms in each: 14x, 12x, 14x; "
        "the last two runs' machine was slower for all CPU-bound work, see the appends' cause)."
    ),
    "restore_and_fetch_over_floor": (
        "S1 meets it on both deployments: the plan (its stages are listed with the figures) "
        "replies once the plan is committed, before the projector takes the restore's resets "
        "(they come while the lines prepared at the checkpoint stream, docs/design.md §10 step "
        "9), and the fetch is the client's decoding (~20 µs an S1 line). S2 cannot: the floor "
        "reads its 350 MB of records as the restore's composition does and decodes only their "
        "metadata (on embedded the large records are views of their blob files' mappings, "
        'docs/design.md "A large state is read in place": no byte of them is copied, ~60 ms), '
        "while a fetch carries them through a socket into a client that decodes every line: "
        "reading and decoding S2's whole stream costs that client ~340-380 ms of CPU, ~157 ms "
        "of it orjson's decoding (measured in process on this machine against a server that "
        "writes the stream at once), on its own several times the floor. The service composes "
        "S2's lines after the plan (350 MB would not fit half the restore cache's budget, so "
        "they are not prepared), reads each state in place and sends it as a chunk of its "
        "own: ~0.30 s of its CPU and ~4.4k page faults a restore + fetch, against 0.57 s and "
        "~88k when it copied the records into fresh memory (benchmarks/restore_fetch.py, two "
        "alternated pairs), so the client's side is now the longer. On Kafka + PostgreSQL "
        "the service reads them back from Tansu (the floor's own work; aiokafka's stream "
        "buffer copies each answer in and out, ~130k page faults a restore + fetch), with "
        "Tansu and the client on the same 2 cores."
    ),
    "restore_and_fetch_vs_stop_the_world_restore": (
        "S1 meets it on both deployments (the split in the row above). S2: the stop-the-world "
        "restore reads and decodes its 350 MB of states from files in one process; restore + "
        "fetch moves them through two: the client's reading and decoding alone (~340-380 ms of "
        "CPU, the row above) is about the baseline's whole restore, and the service's "
        "composition runs beside it on the other core, so the ratio follows the baseline: over "
        "the last three runs S2's restore + fetch took 563, 482 and 572 ms embedded (the last "
        "two reading its states in place, on a slower machine) against a stop-the-world "
        "restore of 636, 498 and 475 ms (1.13x, 1.03x, 0.83x). On Kafka + "
        "PostgreSQL reading them back from Tansu (S2's floor) alone takes longer than the "
        "baseline."
    ),
    "restore_and_fetch_vs_eventsourcing": (
        "pyeventsourcing reads one snapshot row per episode in process; restore + fetch streams "
        "every projection over HTTP as NDJSON (large session states cross a socket and are parsed "
        "in the client). On Kafka + PostgreSQL, S2's floor alone (reading its 350 MB of records "
        "back from Tansu) takes half of pyeventsourcing's whole reconstruction, and the two "
        "are within about 15% of each other, each moving from run to run: over the last three "
        "runs S2's restore + fetch took 1,305, 1,808 and 1,689 ms, pyeventsourcing's "
        "reconstruction 1,371, 1,529 and 1,539 ms (1.05x, 0.85x, 0.91x). The last two runs' "
        "machine was slower (the appends' cause): the previous code and this one, alternated "
        "on it (benchmarks/restore_fetch.py, S2 on Kafka, 3 runs each), took 1,660 and "
        "1,666 ms against 1,622 and 1,633 ms, where the run before had measured 1,305 ms."
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
        "The earlier runs measured 47,900-51,167 events/s at ~20 µs; the last two runs' machine "
        "was slower for all CPU-bound work (29,860 and 37,228 events/s at 23-32 µs of service "
        "CPU per event; the projector's fold 78k and 82k events/s against 106k): the previous "
        "code, alternated with this one on it (benchmarks/api_append.py, one 6 s run each, "
        "with 0 and 1 validation workers), measured 31,160-38,192 events/s against this "
        "code's 34,146-41,411."
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
        "alone takes about that in Python."
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
