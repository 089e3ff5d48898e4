"""A run projector's own health (``ok``, ``degraded``, ``stopped``): the projector sets it,
``_health`` judges the cluster from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["STARTING", "HealthStatus", "RunHealth"]

#: How a run's projector is doing (``RunHealth.status``): ``ok``; ``degraded`` (it hit an error and
#: retries with backoff: it recovers by itself); ``stopped`` (it cannot go on without an operator).
HealthStatus = Literal["ok", "degraded", "stopped"]
#: A projector's ``degraded`` error until its first catch-up with the log ended.
STARTING = "starting: catching up with the log"


@dataclass(frozen=True, slots=True)
class RunHealth:
    """A run projector's health, as ``GET /v1/runs/{run}`` and ``/readyz`` report it."""

    status: HealthStatus
    error: str | None
    #: Since when (unix time) the status holds.
    since: float

    def view(self) -> dict[str, Any]:
        return {"status": self.status, "error": self.error, "since": self.since}
