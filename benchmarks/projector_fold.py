"""The projector's per-record cost: applying S1 records to its trackers (the fold's metadata mode).

In process, no log: S1's rollouts (``workloads.s1_episode``: 10 records each) are encoded as the
log keeps them and fed in partition order to ``Projector._take``, which is what the projector's
follower does with each record it reads: peek the envelope, check it (``metadata_problem``, the
home partition), and apply it to the episode's tracker. Figures: µs per record for the whole
``_take`` and for the tracker's share alone (``EpisodeTracker.observe`` on the same records),
the median of ``--runs`` runs (each on fresh trackers). Timed in CPU seconds of this process
(``time.process_time``): on a shared machine, wall time mostly measures the neighbours. Saved to
``benchmarks/results/projector_fold.json``.

    python benchmarks/projector_fold.py [--episodes 4000] [--runs 7] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import statistics
import time
from typing import Any

import workloads
from _common import save, summary

from rolloutlog.api.cli import GC_THRESHOLDS
from rolloutlog.log import encode_record, partition_for, validate_event
from rolloutlog.projections._projector import Projector
from rolloutlog.projections._tracker import EpisodeTracker

PARTITIONS = 16


def records(episodes: int) -> list[list[bytes]]:
    """Per partition, the S1 records in the order a producer appends them (episode by episode)."""
    out: list[list[bytes]] = [[] for _ in range(PARTITIONS)]
    for index in range(episodes):
        for event in workloads.s1_episode(index):
            typed = validate_event(event)
            out[partition_for(typed.episode, PARTITIONS)].append(encode_record(typed))
    return out


def time_take(partitions: list[list[bytes]]) -> float:
    """Seconds for one projector to take every record (fresh trackers)."""
    projector = Projector(None, "bench", PARTITIONS)  # type: ignore[arg-type]
    projector.caught_up = True
    take = projector._take
    started = time.process_time()
    for partition, page in enumerate(partitions):
        for offset, record in enumerate(page):
            take(partition, offset, record)
    elapsed = time.process_time() - started
    assert not projector.quarantined_count, projector.new_quarantined[:1]
    return elapsed


def time_observe(partitions: list[list[bytes]], peeked: list[list[Any]]) -> float:
    """Seconds for the trackers alone to observe every record (metadata decoded beforehand)."""
    trackers: dict[str, EpisodeTracker] = {}
    whole = "start" in inspect.signature(EpisodeTracker.observe).parameters
    started = time.process_time()
    for partition, page in enumerate(partitions):
        for offset, (record, (meta, start)) in enumerate(zip(page, peeked[partition], strict=True)):
            episode = meta["episode"]
            tracker = trackers.get(episode)
            if tracker is None:
                tracker = trackers[episode] = EpisodeTracker(episode, partition)
            if whole:
                tracker.observe(offset, meta, record, start)
            else:  # before the payload's start was passed in
                tracker.observe(offset, meta, record)  # type: ignore[call-arg]
    return time.process_time() - started


def peek_all(partitions: list[list[bytes]]) -> list[list[Any]]:
    try:
        from rolloutlog.log import peek_record
    except ImportError:  # before the record layout had one owner (log/_record.py)
        from rolloutlog.log import record_meta  # type: ignore[attr-defined]

        return [[(record_meta(record), None) for record in page] for page in partitions]
    return [[peek_record(record) for record in page] for page in partitions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=4000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--label", default="", help="saved as results/projector_fold[_LABEL].json")
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.runs = 500, 3
    gc.set_threshold(*GC_THRESHOLDS)
    partitions = records(args.episodes)
    peeked = peek_all(partitions)
    count = sum(len(page) for page in partitions)
    take_us: list[float] = []
    observe_us: list[float] = []
    for _ in range(args.runs):
        gc.collect()
        take_us.append(time_take(partitions) / count * 1e6)
        gc.collect()
        observe_us.append(time_observe(partitions, peeked) / count * 1e6)
    results = {
        "episodes": args.episodes,
        "records": count,
        "runs": args.runs,
        "quick": args.quick,
        "take_us_per_record": summary(take_us),
        "observe_us_per_record": summary(observe_us),
    }
    print(
        f"{count} records: Projector._take {statistics.median(take_us):.2f} µs/record "
        f"[{min(take_us):.2f}..{max(take_us):.2f}], tracker.observe "
        f"{statistics.median(observe_us):.2f} µs/record"
    )
    name = "projector_fold" + (f"_{args.label}" if args.label else "")
    print(f"saved {save(name + ('_quick' if args.quick else ''), results)}")


if __name__ == "__main__":
    main()
