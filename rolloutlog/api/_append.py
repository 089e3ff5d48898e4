"""``POST /v1/runs/{run}/events``: the hot path.

The body is read in chunks up to the route's byte limit (the body-limit middleware refuses more
without buffering it), parsed once with orjson (which refuses invalid UTF-8, NaN and nesting
deeper than 1024), validated envelope by envelope and encoded (``_prepare``: in a worker process
when the service has one), fenced, and appended as one all-or-nothing batch. Nothing is appended
unless every envelope passes.

Fencing here is the service's early refusal; the fold stays authoritative (an append racing a
restore's commit lands after its ``attempt.started`` record and is ignored there).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from rolloutlog.api._auth import Role, require
from rolloutlog.api._http import NDJSON
from rolloutlog.api._models import AppendOut, ErrorOut, RunPath
from rolloutlog.api._prepare import Batch, records
from rolloutlog.api._service import RunFencing, Service
from rolloutlog.errors import AttemptFenced, ParticipantFenced

__all__ = ["check_fencing", "router"]

router = APIRouter()

_EVENTS_BODY = {
    "description": "A JSON array of event envelopes (DESIGN.md §3), or NDJSON with "
    "`Content-Type: application/x-ndjson`.",
    "required": True,
    "content": {
        "application/json": {"schema": {"type": "array", "items": {"type": "object"}}},
        NDJSON: {"schema": {"type": "string"}},
    },
}


def check_fencing(service: Service, run: str, batch: Batch, fencing: RunFencing) -> bool:
    """Refuse fenced attempts and fenced participant epochs.

    Returns True when an event names a participant id (or epoch) the epoch cache has not seen,
    so the caller may refresh the cache and check again.
    """
    epochs = fencing.epochs
    unknown = False
    for index, episode in enumerate(batch.episodes):
        attempt = batch.attempts[index]
        current = service.current_attempt(run, fencing, episode)
        if attempt < current:
            raise AttemptFenced(
                f"event {index}: attempt {attempt} of episode {episode!r} is fenced; "
                f"the current attempt is {current}",
                index=index,
                episode=episode,
                attempt=attempt,
                current_attempt=current,
            )
        participant, epoch = batch.participants[index]
        registered = epochs.get(participant)
        if registered is None or epoch > registered:
            unknown = True
        elif epoch < registered:
            raise ParticipantFenced(
                f"event {index}: participant {participant!r} epoch {epoch} is fenced; "
                f"its registered epoch is {registered}",
                index=index,
                participant=participant,
                epoch=epoch,
                registered_epoch=registered,
            )
    return unknown


@router.post(
    "/v1/runs/{run}/events",
    summary="Append events (all or nothing)",
    response_model=AppendOut,
    dependencies=[Depends(require(Role.PARTICIPANT))],
    openapi_extra={"requestBody": _EVENTS_BODY},
    responses={
        404: {"model": ErrorOut, "description": "unknown_run"},
        409: {"model": ErrorOut, "description": "attempt_fenced, participant_fenced"},
        413: {"model": ErrorOut, "description": "payload_too_large"},
        422: {"model": ErrorOut, "description": "invalid_event"},
    },
)
async def append_events(request: Request, run: RunPath) -> Response:
    service: Service = request.app.state.service
    started = time.perf_counter()
    service.begin_append()
    try:
        fencing = await service.run_fencing(run)
        chunks = []
        size = 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        ndjson = request.headers.get("content-type", "").startswith(NDJSON)
        log = service.log
        batch = await service.preparer.prepare(
            body, ndjson, await log.partitions(run), log.max_record_bytes
        )
        if check_fencing(service, run, batch, fencing):
            await service.refresh_epochs(run, fencing)
            check_fencing(service, run, batch, fencing)
        positions = await log.append_records(run, records(batch))
    finally:
        service.end_append()
    metrics = service.metrics
    metrics.appends.inc()
    metrics.events.inc(len(positions))
    metrics.bytes.inc(size)
    metrics.append_latency.observe(time.perf_counter() - started)
    offsets = b",".join(b'{"partition":%d,"offset":%d}' % position for position in positions)
    return Response(b'{"offsets":[' + offsets + b"]}", media_type="application/json")
