"""Per-call cost of resolving a parent across policy workers, by option.

A policy call resolves its parent (rows of its capture key with the request's fingerprint) and,
once its ``ledger.row`` is durable, stores its own row for its children. Options measured, each
over ``--episodes`` episodes of ``--calls`` calls (every call's parent is the previous one):

- ``memory``: ``MemoryLedger``, one process's dict: the single-worker baseline (a parent
  recorded by another worker is not found);
- ``sqlite``: ``SharedLedger``, a SQLite file (WAL, no fsync) the workers of one host share;
- ``sqlite-contended``: the same while a second process does the same on other episodes
  (two workers of one policy server);
- ``service-rtt``: one keep-alive HTTP round trip to a real ``rolloutlog serve`` (``GET
  /healthz``, the cheapest route): a lower bound for any lookup through the service, which would
  also need a new route and wait until the fold applied the parent's row.

Per call: wall time of (resolve + store) for the stores, of one round trip for the service, in
microseconds (median and p99 of all calls of the median run). Saved to
``benchmarks/results/policy_ledger.json`` (``--quick``: ``policy_ledger_quick.json``).

    python benchmarks/policy_ledger.py [--runs 3] [--episodes 200] [--calls 10]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _common import percentile, save, serve_command

from rolloutlog.participants import MemoryLedger, SharedLedger, fingerprint
from rolloutlog.participants._ledger import LedgerRowInfo, LedgerStore
from tests._services import free_port


def calls(ledger: LedgerStore, prefix: str, episodes: int, per_episode: int) -> list[float]:
    """Seconds per call: resolve the parent by fingerprint, then store the call's row."""
    timings = []
    for e in range(episodes):
        key = f"{prefix}{e}"
        turns: list[str] = []
        for c in range(per_episode):
            began = time.perf_counter()
            found = ledger.matching(key, fingerprint(turns)) if turns else []
            parent = found[0] if len(found) == 1 else None
            turns.append(f"reply {c}")
            row = LedgerRowInfo(
                f"{key}.c{c}",
                parent.call_id if parent else None,
                fingerprint(turns),
                "ctx",
                1,
                parent.cum_len if parent else 0,
                (c + 1) * 48,
                "digest",
                None,
                False,
                ledger.worker,
            )
            ledger.put(key, row)
            timings.append(time.perf_counter() - began)
            assert c == 0 or parent is not None
    return timings


def _contender(path: str, episodes: int, per_episode: int, rounds: int) -> None:
    ledger = SharedLedger(path, "w1")
    for r in range(rounds):
        calls(ledger, f"other{r}-", episodes, per_episode)


def sqlite_run(episodes: int, per_episode: int, contended: bool) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "ledger.sqlite")
        SharedLedger(path, "setup").close()
        contender = None
        if contended:
            contender = multiprocessing.get_context("spawn").Process(
                target=_contender, args=(path, episodes, per_episode, 1000)
            )
            contender.start()
            time.sleep(1.0)  # the contender is writing
        try:
            ledger = SharedLedger(path, "w0")
            timings = calls(ledger, "e", episodes, per_episode)
            ledger.close()
        finally:
            if contender is not None:
                contender.kill()
                contender.join()
        return timings


def service_run(requests: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        proc = subprocess.Popen(
            serve_command(tmp, port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        if client.get("/healthz").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError("the service did not start")
                    time.sleep(0.1)
                timings = []
                for _ in range(requests):
                    began = time.perf_counter()
                    client.get("/healthz").raise_for_status()
                    timings.append(time.perf_counter() - began)
                return timings
        finally:
            proc.terminate()
            proc.wait(30)


def figures(runs: list[list[float]]) -> dict[str, Any]:
    medians = [statistics.median(r) for r in runs]
    middle = runs[medians.index(statistics.median_low(medians))]
    return {
        "median_us": round(statistics.median(middle) * 1e6, 1),
        "p99_us": round(percentile(middle, 99) * 1e6, 1),
        "run_medians_us": [round(m * 1e6, 1) for m in medians],
        "calls": len(middle),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    total = args.episodes * args.calls
    results: dict[str, Any] = {}
    cases = {
        "memory": lambda: calls(MemoryLedger(), "e", args.episodes, args.calls),
        "sqlite": lambda: sqlite_run(args.episodes, args.calls, False),
        "sqlite-contended": lambda: sqlite_run(args.episodes, args.calls, True),
        "service-rtt": lambda: service_run(total),
    }
    for name, case in cases.items():
        results[name] = figures([case() for _ in range(runs)])
        print(f"{name:>17}: {results[name]['median_us']:8.1f} us median, "
              f"{results[name]['p99_us']:8.1f} us p99 per call")  # fmt: skip
    save(
        "policy_ledger_quick" if args.quick else "policy_ledger",
        {"episodes": args.episodes, "calls_per_episode": args.calls, "results": results},
    )


if __name__ == "__main__":
    main()
