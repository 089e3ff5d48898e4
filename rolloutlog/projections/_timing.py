"""Small clocks the coordinator's runners share: stage timings and retry backoff."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from rolloutlog._telemetry import StageParent, stage_parent

__all__ = ["RETRY_MAX_S", "StageTimer", "backoff_s"]

#: Catalog writes the service owes (episode records, a failed checkpoint's abort) are retried
#: with exponential backoff capped here, jittered so that runs and replicas spread out.
RETRY_MAX_S = 5.0


@dataclass
class StageTimer:
    """Milliseconds per named stage of a checkpoint or restore (its ``timings_ms``); while
    tracing is on, each stage is also a span, a child of the span current at construction
    (``rolloutlog.checkpoint`` → ``rolloutlog.checkpoint.markers``, …)."""

    started: float = field(default_factory=time.perf_counter)
    last: float = field(default_factory=time.perf_counter)
    stages: dict[str, float] = field(default_factory=dict)
    parent: StageParent | None = field(default_factory=stage_parent)

    def stage(self, name: str) -> None:
        now = time.perf_counter()
        self.stages[name] = round((now - self.last) * 1000, 3)
        if self.parent is not None:
            self.parent.record(name, now - self.last)
        self.last = now

    def total(self) -> dict[str, float]:
        return {**self.stages, "total": round((time.perf_counter() - self.started) * 1000, 3)}


def backoff_s(failures: int, first_s: float) -> float:
    """The delay before retry number ``failures`` (1, 2, …): doubling from ``first_s`` up to
    ``RETRY_MAX_S``, times a random factor in [0.5, 1]."""
    delay: float = min(RETRY_MAX_S, first_s * 2.0 ** min(failures - 1, 16))
    return delay * random.uniform(0.5, 1.0)
