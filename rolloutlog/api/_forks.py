"""Forks over REST: ``POST /v1/runs`` with ``fork`` creates a run as a branch of another run's
committed checkpoint (``projections/_fork.py``); a run's view says what it was forked from and
lists its forks.

A fork's lineage names its source only to a token that holds a role on the source (``shown``:
``_auth.runs_known``): to another, ``forked_from.run`` is null (the rest, the checkpoint and
when, is the fork's own), so a run out of a token's scope is not revealed through its forks."""

from __future__ import annotations

from typing import Any

from fastapi.responses import Response

from rolloutlog.api._http import json_response
from rolloutlog.api._models import CreateRun
from rolloutlog.api._service import Service
from rolloutlog.api._tokens import EVERY_RUN, RunScope
from rolloutlog.catalog import Catalog, Episode, Run
from rolloutlog.core import capture_key
from rolloutlog.projections import ForkRequest

__all__ = [
    "create_fork",
    "episode_origin",
    "fork_view",
    "forked_from_view",
    "mark_source_attempts",
]


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
        "forked_from": forked_from_view(result.run, EVERY_RUN),  # the token holds the source
    }
    if result.counts:
        reply["counts"] = result.counts
    # What the fork's checkpoint 1 references, as a checkpoint's reply lists them: the
    # trainer's token store keeps each while a run's latest checkpoint lists it.
    reply["staging_keys"] = result.staging_keys
    return json_response(reply, 201 if result.created else 200)


def _source_name(source: str, shown: RunScope) -> str | None:
    """The source's name, or None when the asking token holds no role on it."""
    return source if shown.covers(source) else None


def forked_from_view(run: Run, shown: RunScope) -> dict[str, Any] | None:
    """``{"run", "checkpoint_id", "at"}`` of a fork, None for a run that is no fork; ``run``
    is None when the source is out of ``shown``."""
    if run.forked_from_run is None:
        return None
    return {
        "run": _source_name(run.forked_from_run, shown),
        "checkpoint_id": run.forked_from_checkpoint,
        "at": run.forked_at,
    }


async def episode_origin(
    catalog: Catalog, run: str, episode: Episode | None, shown: RunScope
) -> dict[str, Any] | None:
    """Where a fork's episode came from: the source run (None when out of ``shown``), its
    checkpoint, the attempt it had there and that attempt's capture key; None for an episode
    that was not forked."""
    if episode is None or episode.forked_attempt is None:
        return None
    info = await catalog.get_run(run)
    assert info.forked_from_run is not None  # a forked episode's run is a fork
    return {
        "run": _source_name(info.forked_from_run, shown),
        "checkpoint_id": info.forked_from_checkpoint,
        "attempt": episode.forked_attempt,
        "capture_key": capture_key(episode.episode, episode.forked_attempt),
        "at": info.forked_at,
    }


def mark_source_attempts(
    attempts: list[dict[str, Any]], origin: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The history's attempts, those that happened in the source before the fork marked
    ``in_source`` (their records are copies of the source's), the source named as ``origin``
    names it."""
    if origin is None:
        return attempts
    source = "the source run" if origin["run"] is None else f"run {origin['run']!r}"
    for attempt in attempts:
        attempt["in_source"] = attempt["attempt"] <= origin["attempt"]
        if attempt["in_source"]:
            attempt["why"] = (
                f"in {source} before the fork of its checkpoint "
                f"{origin['checkpoint_id']}: {attempt['why']}"
            )
    return attempts


def fork_view(fork: Run) -> dict[str, Any]:
    """One fork as its source lists it."""
    return {"run": fork.run, "checkpoint_id": fork.forked_from_checkpoint, "at": fork.forked_at}
