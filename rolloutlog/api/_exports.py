"""Export requests of export-on-checkpoint sessions: a participant's long poll for the sessions
the run's pending checkpoint waits for (docs/api.md, "Checkpoint exports")."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel

from rolloutlog.api._auth import PARTICIPANT
from rolloutlog.api._http import json_response
from rolloutlog.api._models import ErrorOut, RunPath
from rolloutlog.api._service import Service

__all__ = ["router"]

router = APIRouter()

#: The longest a poll may wait: below common proxies' idle timeouts.
MAX_WAIT_S = 60.0


class ExportSession(BaseModel):
    episode: str
    attempt: int
    capture_key: str
    session_id: str


class ExportRequest(BaseModel):
    checkpoint_id: int
    #: Unix time at which the checkpoint stops waiting (its episodes without exports restart).
    deadline_at: float
    sessions: list[ExportSession]


@router.get(
    "/v1/runs/{run}/checkpoints/pending/exports",
    summary="Sessions a pending checkpoint waits to be exported by this participant (long poll)",
    response_model=ExportRequest,
    dependencies=PARTICIPANT,
    responses={
        204: {"description": "no checkpoint waited for an export of this participant in wait_s"},
        404: {"model": ErrorOut, "description": "unknown_run"},
    },
)
async def pending_exports(
    request: Request,
    run: RunPath,
    participant: Annotated[str, Query(min_length=1, max_length=200)],
    wait_s: Annotated[float, Query(ge=0, le=MAX_WAIT_S)] = 20.0,
) -> Response:
    service: Service = request.app.state.service
    found: dict[str, Any] | None = await service.coordinator.pending_exports(
        run, participant, wait_s
    )
    if found is None:
        return Response(status_code=204)
    return json_response(found)
