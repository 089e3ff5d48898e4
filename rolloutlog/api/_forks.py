"""Forks over REST: ``POST /v1/runs`` with ``fork`` creates a run as a branch of another run's
committed checkpoint (``projections/_fork.py``); a run's view says what it was forked from and
lists its forks."""

from __future__ import annotations

from typing import Any

from fastapi.responses import Response

from rolloutlog.api._http import json_response
from rolloutlog.api._models import CreateRun
from rolloutlog.api._service import Service
from rolloutlog.catalog import Run
from rolloutlog.projections import ForkRequest

__all__ = ["create_fork", "fork_view", "forked_from_view"]


async def create_fork(service: Service, body: CreateRun) -> Response:
    """201 with the fork created, 200 when the same fork existed (``run_exists`` otherwise)."""
    spec = body.fork
    assert spec is not None
    request = ForkRequest(
        source=spec.run,
        checkpoint=spec.checkpoint_id,
        episodes=None if spec.episodes is None else tuple(spec.episodes),
        exclude=tuple(spec.exclude),
    )
    result = await service.coordinator.fork_run(body.run, request, body.partitions)
    reply: dict[str, Any] = {
        "run": body.run,
        "partitions": result.run.partitions,
        "forked_from": result.forked_from(),
    }
    if result.counts:
        reply["counts"] = result.counts
    return json_response(reply, 201 if result.created else 200)


def forked_from_view(run: Run) -> dict[str, Any] | None:
    """``{"run", "checkpoint_id", "at"}`` of a fork, None for a run that is no fork."""
    if run.forked_from_run is None:
        return None
    return {
        "run": run.forked_from_run,
        "checkpoint_id": run.forked_from_checkpoint,
        "at": run.forked_at,
    }


def fork_view(fork: Run) -> dict[str, Any]:
    """One fork as its source lists it."""
    return {"run": fork.run, "checkpoint_id": fork.forked_from_checkpoint, "at": fork.forked_at}
