"""``POST /v1/runs/{run}/events``: the hot path.

The body is read in chunks up to the route's byte limit (the body-limit middleware refuses more
without buffering it), parsed once with orjson (which refuses invalid UTF-8, NaN and nesting
deeper than 1024), validated envelope by envelope, fenced, and appended as one all-or-nothing
batch. Nothing is appended unless every envelope passes.

Fencing here is the service's early refusal; the fold stays authoritative (an append racing a
restore's commit lands after its ``attempt.started`` record and is ignored there).
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from rolloutlog.api._auth import Role, require
from rolloutlog.api._http import NDJSON
from rolloutlog.api._models import AppendOut, ErrorOut, RunPath
from rolloutlog.api._service import Service
from rolloutlog.errors import AttemptFenced, InvalidEvent, InvalidRequest, ParticipantFenced
from rolloutlog.log import SERVICE_EVENT_TYPES, Event, validate_events

__all__ = ["parse_body", "router"]

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


def parse_body(body: bytes | bytearray, ndjson: bool) -> list[Any]:
    """The envelopes of a request body (still unvalidated dicts)."""
    if ndjson:
        values: list[Any] = []
        for line in body.splitlines():
            if not line.strip():
                continue
            try:
                values.append(orjson.loads(line))
            except orjson.JSONDecodeError as e:
                index = len(values)
                raise InvalidEvent(
                    f"event {index}: not valid JSON: {e}",
                    index=index,
                    field="(envelope)",
                    reason=str(e),
                ) from e
        return values
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidEvent(f"the body is not valid JSON: {e}", field="(body)", reason=str(e)) from e
    if not isinstance(value, list):
        raise InvalidRequest(
            "the body must be a JSON array of event envelopes (or NDJSON with "
            f"Content-Type: {NDJSON})",
            field="(body)",
        )
    return value


def check_fencing(service: Service, run: str, events: list[Event], fencing: Any) -> bool:
    """Refuse service-only events, fenced attempts and fenced participant epochs.

    Returns True when an event names a participant id (or epoch) the epoch cache has not seen,
    so the caller may refresh the cache and check again.
    """
    epochs = fencing.epochs
    unknown = False
    for index, event in enumerate(events):
        if event.type in SERVICE_EVENT_TYPES or event.participant.kind == "service":
            raise InvalidEvent(
                f"event {index}: {event.type} events are written by the service only",
                index=index,
                field="type" if event.type in SERVICE_EVENT_TYPES else "participant.kind",
            )
        assert event.episode is not None
        current = service.current_attempt(run, fencing, event.episode)
        if event.attempt < current:
            raise AttemptFenced(
                f"event {index}: attempt {event.attempt} of episode {event.episode!r} is fenced; "
                f"the current attempt is {current}",
                index=index,
                episode=event.episode,
                attempt=event.attempt,
                current_attempt=current,
            )
        who = event.participant
        registered = epochs.get(who.id)
        if registered is None or who.epoch > registered:
            unknown = True
        elif who.epoch < registered:
            raise ParticipantFenced(
                f"event {index}: participant {who.id!r} epoch {who.epoch} is fenced; "
                f"its registered epoch is {registered}",
                index=index,
                participant=who.id,
                epoch=who.epoch,
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
        events = validate_events(parse_body(body, ndjson))
        if check_fencing(service, run, events, fencing):
            await service.refresh_epochs(run, fencing)
            check_fencing(service, run, events, fencing)
        positions = await service.log.append(run, events)
    finally:
        service.end_append()
    metrics = service.metrics
    metrics.appends.inc()
    metrics.events.inc(len(events))
    metrics.bytes.inc(size)
    metrics.append_latency.observe(time.perf_counter() - started)
    offsets = b",".join(b'{"partition":%d,"offset":%d}' % position for position in positions)
    return Response(b'{"offsets":[' + offsets + b"]}", media_type="application/json")
