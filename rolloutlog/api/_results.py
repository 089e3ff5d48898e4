"""Finished episodes' results for the trainer: read them (NDJSON) and acknowledge the
ones it holds. Both routes first bring the catalog up to the log (``Coordinator.sync_results``):
an environment appends ``episode.finished`` before its reply leaves, so any result the trainer
received, or whose reply was lost, is there by the time it asks."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import Field

from rolloutlog.api._auth import ANALYST, TRAINER
from rolloutlog.api._http import json_response, stream_ndjson
from rolloutlog.api._models import ErrorOut, Name, Responses, RunPath, _Request, _Response
from rolloutlog.api._service import Service
from rolloutlog.catalog import FinishedResult
from rolloutlog.errors import InvalidRequest
from rolloutlog.log import NAME_PATTERN

__all__ = ["AckOut", "AckRequest", "ResultOut", "result_view", "router"]

router = APIRouter()

#: Results per catalog read while streaming.
PAGE = 2000
_NAME = re.compile(NAME_PATTERN)

NOT_FOUND: Responses = {
    404: {"model": ErrorOut, "description": "unknown_run, unknown_checkpoint (since_checkpoint)"}
}


class ResultOut(_Response):
    """One finished episode's result (one NDJSON line)."""

    episode: str
    attempt: int
    capture_key: str
    reward: float | None
    result: Any = Field(description="The environment's opaque result, as it appended it.")
    finished_offset: int
    partition: int
    ts: float
    acknowledged: bool
    acknowledged_at: float | None


class AckRequest(_Request):
    episodes: Annotated[list[Name], Field(min_length=1, max_length=100_000)]


class AckOut(_Response):
    acknowledged: int = Field(description="How many results this request acknowledged.")
    already: int = Field(description="Results acknowledged before (acknowledging is idempotent).")
    unknown: list[str] = Field(description="Episodes the service holds no finished result of.")


def result_view(result: FinishedResult) -> dict[str, Any]:
    return {
        "episode": result.episode,
        "attempt": result.attempt,
        "capture_key": result.capture_key,
        "reward": result.reward,
        "result": orjson.Fragment(result.result) if result.result is not None else None,
        "finished_offset": result.finished_offset,
        "partition": result.partition,
        "ts": result.ts,
        "acknowledged": result.acknowledged_at is not None,
        "acknowledged_at": result.acknowledged_at,
    }


def _names(values: list[str] | None) -> list[str] | None:
    """``episodes=a&episodes=b`` and ``episodes=a,b`` alike."""
    if values is None:
        return None
    names = [name for value in values for name in value.split(",") if name]
    for name in names:
        if not _NAME.match(name):
            raise InvalidRequest(f"episodes: {name[:100]!r} is not an episode id", field="episodes")
    return names


@router.get(
    "/v1/runs/{run}/results",
    summary="Finished episodes' results (NDJSON), optionally only the unacknowledged ones",
    response_model=ResultOut,
    dependencies=ANALYST,
    responses={200: {"content": {"application/x-ndjson": {}}}, **NOT_FOUND},
)
async def list_results(
    request: Request,
    run: RunPath,
    since_checkpoint: Annotated[
        int | None,
        Query(ge=0, le=2**62, description="Only results finished past this checkpoint's cut."),
    ] = None,
    episodes: Annotated[
        list[str] | None, Query(max_length=100_000, description="Only these episodes.")
    ] = None,
    unacknowledged: Annotated[
        bool, Query(description="Only results the trainer has not acknowledged.")
    ] = False,
) -> Response:
    service: Service = request.app.state.service
    names = _names(episodes)
    await service.coordinator.sync_results(run)

    async def read(after: str | None) -> list[FinishedResult]:
        return await service.catalog.results_page(
            run,
            since_checkpoint=since_checkpoint,
            episodes=names,
            unacknowledged=unacknowledged,
            after=after,
            limit=PAGE,
        )

    # The first page before the stream starts: an unknown run or checkpoint is a proper 404.
    first = await read(None)

    async def pages() -> AsyncIterator[FinishedResult]:
        page = first
        while True:
            for result in page:
                yield result
            if len(page) < PAGE:
                return
            page = await read(page[-1].episode)

    return stream_ndjson(pages(), result_view)


@router.post(
    "/v1/runs/{run}/results/ack",
    summary="Acknowledge results the trainer holds (idempotent; never returned as unacknowledged)",
    response_model=AckOut,
    dependencies=TRAINER,
    responses={404: {"model": ErrorOut, "description": "unknown_run"}},
)
async def acknowledge(request: Request, run: RunPath, body: AckRequest) -> Response:
    service: Service = request.app.state.service
    # A result whose reply reached the trainer is in the log; recorded first, so this
    # acknowledgement can never miss it (and see it come back after a restore).
    await service.coordinator.sync_results(run)
    newly, unknown = await service.catalog.acknowledge_results(run, body.episodes)
    held = len(set(body.episodes)) - len(unknown)
    return json_response({"acknowledged": newly, "already": held - newly, "unknown": unknown})
