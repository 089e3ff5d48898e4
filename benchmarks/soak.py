"""Benchmark: the nemesis soak — three replicas on Tansu and a throwaway PostgreSQL under a long
seeded random schedule of faults (replicas SIGKILLed and restarted or SIGSTOPped past the
lease, the broker SIGSTOPped or its connections reset, the catalog SIGKILLed and restarted),
with appends, checkpoints and restores going on (``tests/e2e/_nemesis.py``, the same as the CI
case's, longer).

Prints each fault's recovery as it goes, then the figures, saved to
``benchmarks/results/soak.json``: appends acknowledged and refused, checkpoints and restores
asked and committed, and per fault kind the seconds from the fault's end to the first
checkpoint asked after it that committed (``recovered_s``; ``any_commit_s``: answered after
it), to every replica healthy (``healthy_s``), p50 and max. Exits 1 on a safety failure or a
recovery past the bound (two leases and one checkpoint deadline), naming the seed.

    make soak                                  # 10 minutes
    python benchmarks/soak.py --minutes 3 --seed 7 --kinds replica_kill,replica_stop
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from _common import save

from tests.e2e._nemesis import KINDS, SEED_VARIABLE, seed_from_env, soak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="the schedule's length")
    parser.add_argument("--seed", type=int, default=None, help=f"else {SEED_VARIABLE}, or fresh")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"the fault kinds drawn from (of {KINDS})"
    )
    parser.add_argument("--no-save", action="store_true", help="print the figures only")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else seed_from_env()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not set(kinds) <= set(KINDS):
        parser.error(f"--kinds: not fault kinds: {sorted(set(kinds) - set(KINDS))}")
    with tempfile.TemporaryDirectory(prefix="rolloutlog-soak-") as workdir:
        figures = asyncio.run(soak(args.minutes, seed, Path(workdir), kinds))
    print(json.dumps({k: v for k, v in figures.items() if k != "schedule"}, indent=2))
    if not args.no_save:
        print(save("soak", figures), file=sys.stderr)
    failed = figures["safety_failure"] or figures["liveness_failures"]
    if failed:
        print(f"soak FAILED (seed {seed}; replay with --seed {seed}): {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
