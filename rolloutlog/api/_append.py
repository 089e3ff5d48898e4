"""``POST /v1/runs/{run}/events``: the hot path.

The body is read in chunks up to the route's byte limit (the body-limit middleware refuses more
without buffering it), parsed once with orjson (which refuses invalid UTF-8, NaN and nesting
deeper than 1024), validated envelope by envelope and encoded (``_prepare``: in a worker process
when the service has one, a slice at a time when it is big), fenced, and appended as one
all-or-nothing batch. Nothing is appended unless every envelope passes.

Fencing refuses every event the fold would drop once acknowledged (retries of an acknowledged
``seq`` excepted): attempts other than the current one, epochs other than the registered one, and
seqs that jump absurdly (docs/api.md, "Acknowledged means kept"). A refusal that another
replica's registration or restore could lift waits for a fresh reload from the catalog first.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from rolloutlog._telemetry import set_attributes, span
from rolloutlog.api._auth import CHECKS, PARTICIPANT, Role, authorize
from rolloutlog.api._bodies import BODY_METER, BodyMeter
from rolloutlog.api._http import NDJSON
from rolloutlog.api._models import RUN_PATTERN, AppendOut, ErrorOut, RunPath
from rolloutlog.api._prepare import Batch, records, records_sliced, release
from rolloutlog.api._service import RunFencing, Service
from rolloutlog.errors import (
    AttemptFenced,
    InvalidEvent,
    InvalidRequest,
    ParticipantFenced,
    RolloutlogError,
)

__all__ = ["check_fencing", "router"]


class LeanRoute(APIRoute):
    """The events route answered without FastAPI's per-request machinery (solving the route's
    dependencies, two exit stacks, a ``Response`` object): the hot path of every participant.

    Its path, schema, role and answers stay the route's own: its role is checked by the very
    dependency it declares (``authorize``), a run name that the path's pattern refuses is handed
    to FastAPI's handler (its ``400`` with the problems), and every refusal is raised to the
    app's one error handler as before. Measured: see docs/api.md, "Appending events"."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fastapi_app = self.app
        self.app = self._serve

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        run = scope["path_params"]["run"]
        if _RUN_NAME.match(run) is None:
            await self._fastapi_app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        await authorize(request, CHECKS[Role.PARTICIPANT])
        reply = await _append(request, run)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(reply)), _JSON],
            }
        )
        await send({"type": "http.response.body", "body": reply})


_RUN_NAME = re.compile(RUN_PATTERN)
_JSON = (b"content-type", b"application/json")

router = APIRouter()

_EVENTS_BODY = {
    "description": "A JSON array of event envelopes (docs/design.md §3), or NDJSON with "
    "`Content-Type: application/x-ndjson`.",
    "required": True,
    "content": {
        "application/json": {"schema": {"type": "array", "items": {"type": "object"}}},
        NDJSON: {"schema": {"type": "string"}},
    },
}


def _fence(
    service: Service, run: str, batch: Batch, fencing: RunFencing
) -> tuple[RolloutlogError | None, bool, bool]:
    """The refusal of the batch's first fenced event (None if none), and whether a reload of the
    registrations or of the attempts could lift it (another replica may have made the change)."""
    epochs = fencing.epochs
    for (episode, attempt, participant, epoch), index in batch.keys.items():
        current = service.current_attempt(run, fencing, episode)
        if service.excluded(run, episode):
            error: RolloutlogError = AttemptFenced(
                f"event {index}: episode {episode!r} was excluded by a restore (the trainer "
                "holds its result); it has no current attempt",
                index=index,
                episode=episode,
                attempt=attempt,
                current_attempt=current,
            )
            return error, False, False
        if attempt != current:
            error = AttemptFenced(
                f"event {index}: attempt {attempt} of episode {episode!r} is "
                + ("fenced" if attempt < current else "not one a restore began")
                + f"; the current attempt is {current}",
                index=index,
                episode=episode,
                attempt=attempt,
                current_attempt=current,
            )
            return error, False, attempt > current
        registered = epochs.get(participant)
        if registered is None or epoch != registered:
            if registered is None:
                reason = f"participant {participant!r} is not registered in run {run!r}"
            elif epoch < registered:
                reason = (
                    f"participant {participant!r} epoch {epoch} is fenced; "
                    f"its registered epoch is {registered}"
                )
            else:
                reason = (
                    f"participant {participant!r} was never granted epoch {epoch}; "
                    f"its registered epoch is {registered}"
                )
            error = ParticipantFenced(
                f"event {index}: {reason}",
                index=index,
                participant=participant,
                epoch=epoch,
                registered_epoch=registered,
            )
            return error, registered is None or epoch > registered, False
    return None, False, False


def _seq_jump(
    service: Service, run: str, batch: Batch, fencing: RunFencing, look_in_log: bool
) -> InvalidEvent | None:
    """The refusal of a ``seq`` more than ``max_seq_gap`` past its participant epoch's highest
    (this service's own, or also the log's with ``look_in_log``), or None."""
    gap = service.settings.max_seq_gap
    for participant, (lowest, highest, index) in batch.seqs.items():
        known = fencing.seqs.get(participant)
        if known is None or look_in_log:
            seen = service.highest_seq(run, fencing, participant)
            known = seen if seen is not None else known
        base = lowest if known is None else known
        if highest > base + gap:
            return InvalidEvent(
                f"event {index}: seq {highest} of participant {participant[0]!r} epoch "
                f"{participant[1]} jumps more than {gap} past its highest seq {base}",
                index=index,
                field="seq",
                seq=highest,
                highest_seq=base,
                max_seq_gap=gap,
            )
    return None


async def check_fencing(service: Service, run: str, batch: Batch, fencing: RunFencing) -> None:
    """Refuse every event the fold would drop once appended, duplicates excepted (docs/api.md):
    fenced or not-yet-begun attempts, epochs lower or higher than the registered one, and seqs
    that jump absurdly. A refusal a reload could lift is checked again after one."""
    since = time.monotonic()
    error, epochs_stale, attempts_stale = _fence(service, run, batch, fencing)
    # Each reload at most once; a check after one may find the other stale (an attempt a restore
    # on another replica began, then the epoch its participant registered there).
    epochs_loaded = attempts_loaded = False
    while error is not None and (
        (epochs_stale and not epochs_loaded) or (attempts_stale and not attempts_loaded)
    ):
        if epochs_stale and not epochs_loaded:
            await service.refresh_epochs(fencing, since)
            epochs_loaded = True
        if attempts_stale and not attempts_loaded:
            await service.refresh_attempts(fencing, since)
            attempts_loaded = True
        error, epochs_stale, attempts_stale = _fence(service, run, batch, fencing)
    if error is None and _seq_jump(service, run, batch, fencing, False) is not None:
        error = _seq_jump(service, run, batch, fencing, True)
    if error is not None:
        raise error


#: Batches of more events than this are turned into records, answered and freed a slice at a time.
SLICED_EVENTS = 8192


#: One acknowledged position's JSON (``%`` with a (partition, offset) tuple).
_POSITION = b'{"partition":%d,"offset":%d}'.__mod__


async def _offsets_body(positions: Sequence[tuple[int, int]]) -> bytes:
    if len(positions) <= SLICED_EVENTS:
        return b'{"offsets":[%b]}' % b",".join(map(_POSITION, positions))
    parts = []
    for start in range(0, len(positions), SLICED_EVENTS):
        parts.append(b",".join(map(_POSITION, positions[start : start + SLICED_EVENTS])))
        await asyncio.sleep(0)  # a 200,000-event reply is built a slice at a time
    return b'{"offsets":[' + b",".join(parts) + b"]}"


async def append_events(request: Request, run: RunPath) -> Response:
    # What FastAPI serves when ``LeanRoute`` hands a request over (a run name it refuses).
    return Response(await _append(request, run), media_type="application/json")


# ``LeanRoute`` serves this one route itself (its ``_serve`` is the append).
router.add_api_route(
    "/v1/runs/{run}/events",
    append_events,
    methods=["POST"],
    route_class_override=LeanRoute,
    summary="Append events (all or nothing)",
    response_model=AppendOut,
    dependencies=PARTICIPANT,
    openapi_extra={"requestBody": _EVENTS_BODY},
    responses={
        404: {"model": ErrorOut, "description": "unknown_run"},
        408: {"model": ErrorOut, "description": "request_timeout"},
        409: {"model": ErrorOut, "description": "attempt_fenced, participant_fenced"},
        413: {"model": ErrorOut, "description": "payload_too_large"},
        422: {"model": ErrorOut, "description": "invalid_event"},
        503: {"model": ErrorOut, "description": "unavailable"},
    },
)


async def _append(request: Request, run: str) -> bytes:
    """Append the request's batch; the reply's body."""
    service: Service = request.app.state.service
    started = time.perf_counter()
    meter: BodyMeter | None = request.scope.get(BODY_METER)
    service.begin_append(meter)
    try:
        fencing = await service.run_fencing(run)
        chunks = []
        size = 0
        try:
            async for chunk in request.stream():
                chunks.append(chunk)
                size += len(chunk)
        except ClientDisconnect as e:
            raise InvalidRequest("the client went away before its body was complete") from e
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        ndjson = request.headers.get("content-type", "").startswith(NDJSON)
        log = service.log
        with span("rolloutlog.append.validate"):
            batch = await service.preparer.prepare(
                body, ndjson, await log.partitions(run), log.max_record_bytes
            )
            await check_fencing(service, run, batch, fencing)
        big = len(batch.values) > SLICED_EVENTS
        prepared = await records_sliced(batch) if big else records(batch)
        with span("rolloutlog.append.log"):
            positions = await log.append_records(run, prepared)
        service.note_seqs(fencing, ((who, seqs[1]) for who, seqs in batch.seqs.items()))
        count = len(positions)
        reply = await _offsets_body(positions)
        if big:
            await release(prepared, batch.values, batch.episodes, batch.partitions, positions)
    finally:
        service.end_append(meter)
    set_attributes({"rolloutlog.run": run, "rolloutlog.events": count, "rolloutlog.bytes": size})
    metrics = service.metrics
    metrics.appends.inc()
    metrics.events.inc(count)
    metrics.bytes.inc(size)
    metrics.append_latency.observe(time.perf_counter() - started)
    return reply
