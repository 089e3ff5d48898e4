"""The trainer client's cost of a checkpoint reply that says what changed in the staging keys
(``StagingKeys.info``), at S1 x 4 and S1 x 12 live rollouts' keys (three per rollout).

Per reply: 200 keys added, 200 removed. *composed* = ``info`` as the client runs it (the keys
listed only when read); *listed* = ``info`` and then every key listed (what every reply cost
before ``StagingKeyList``: a tuple of all the keys). Same process, alternating, median of 40
replies each. Saves ``results/staging_keys.json``."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from _common import save, summary

from rolloutlog.trainer._types import StagingKeys

REPLIES = 40
CHANGED = 200


def _replies(keys: int) -> dict[str, Any]:
    names = [f"run/ep-{i:06d}/call-{i % 7}" for i in range(keys)]
    held = {"composed": StagingKeys(), "listed": StagingKeys()}
    for client in held.values():
        client.info("r", {"checkpoint_id": 1, "status": "committed", "staging_keys": names})
    times: dict[str, list[float]] = {"composed": [], "listed": []}
    kept: dict[str, Any] = {}  # the previous reply stays referenced, as in a trainer's loop
    for n in range(2, REPLIES + 2):
        added = [f"run/ep-{keys + n * CHANGED + j:06d}/x" for j in range(CHANGED)]
        removed = names[(n - 2) * CHANGED : (n - 1) * CHANGED]
        body = {
            "checkpoint_id": n,
            "status": "committed",
            "staging_keys_since": n - 1,
            "staging_keys_added": added,
            "staging_keys_removed": removed,
            "staging_key_count": keys,
        }
        for mode in ("composed", "listed") if n % 2 else ("listed", "composed"):
            gc.collect()
            start = time.perf_counter()
            info = held[mode].info("r", body)
            if mode == "listed":
                tuple(info.staging_keys or ())
            times[mode].append((time.perf_counter() - start) * 1e3)
            kept[mode] = info
    return {
        "keys": keys,
        **{f"{mode}_ms": summary(values) for mode, values in times.items()},
        "listed_over_composed": statistics.median(times["listed"])
        / statistics.median(times["composed"]),
    }


def main() -> None:
    points = [_replies(keys) for keys in (48_000, 192_000)]
    for point in points:
        print(
            f"{point['keys']:>7,} keys: composed {point['composed_ms']['median']:.3f} ms, "
            f"listed {point['listed_ms']['median']:.2f} ms per reply"
        )
    save(
        "staging_keys",
        {
            "what": "trainer client CPU per delta checkpoint reply (200 keys added, 200 "
            "removed), composed (listed when read) vs listed at once",
            "replies": REPLIES,
            "points": points,
        },
    )


if __name__ == "__main__":
    main()
