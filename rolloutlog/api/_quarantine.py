"""The quarantine listing: log records the projector skipped (not a valid envelope, or the fold
could not apply them), for analysts."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from rolloutlog.api._auth import ANALYST
from rolloutlog.api._http import json_response
from rolloutlog.api._models import ErrorOut, QuarantineList, RunPath
from rolloutlog.api._service import Service
from rolloutlog.catalog import QuarantinedRecord
from rolloutlog.errors import InvalidRequest

__all__ = ["router"]

router = APIRouter()

#: ``after`` is the last record's ``"partition:offset"``.
After = Annotated[str | None, Query(max_length=40, pattern=r"^\d{1,9}:\d{1,19}$")]


def _view(record: QuarantinedRecord) -> dict[str, object]:
    return {
        "partition": record.partition,
        "offset": record.offset,
        "reason": record.reason,
        "size": record.size,
        "first_bytes": record.first_bytes.decode("utf-8", errors="backslashreplace"),
        "recorded_at": record.recorded_at,
    }


@router.get(
    "/v1/runs/{run}/quarantine",
    summary="Quarantined log records (skipped: not a valid envelope, or unfoldable)",
    response_model=QuarantineList,
    dependencies=ANALYST,
    responses={404: {"model": ErrorOut, "description": "unknown_run"}},
)
async def list_quarantine(
    request: Request,
    run: RunPath,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> Response:
    service: Service = request.app.state.service
    position: tuple[int, int] | None = None
    if after is not None:
        partition, offset = after.split(":")
        position = (int(partition), int(offset))
        if position[1] >= 1 << 63:
            raise InvalidRequest("after: offset out of range", field="after")
    records = await service.catalog.quarantined(run, after=position, limit=limit)
    next_after = f"{records[-1].partition}:{records[-1].offset}" if len(records) == limit else None
    return json_response({"records": [_view(r) for r in records], "next_after": next_after})
