"""Routes of checkpoints, manifests, restores and projections."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from rolloutlog._telemetry import span
from rolloutlog.api._auth import ANALYST, PARTICIPANT, TRAINER
from rolloutlog.api._http import (
    JSON,
    json_response,
    stream_json_object,
    stream_ndjson,
    stream_ndjson_lines,
    wants_ndjson,
)
from rolloutlog.api._models import (
    REQUEST_ID_PATTERN,
    CheckpointList,
    CheckpointOut,
    CheckpointRequest,
    EpisodePath,
    ErrorOut,
    IdPath,
    ManifestOut,
    ProjectionOut,
    Responses,
    RestoreDetail,
    RestoreEpisodes,
    RestoreList,
    RestoreOut,
    RestoreRequest,
    RunPath,
)
from rolloutlog.api._observe import Audited
from rolloutlog.api._service import Service
from rolloutlog.api._views import (
    checkpoint_view,
    manifest_entry_view,
    restore_entry_view,
    restore_view,
)
from rolloutlog.catalog import ManifestEntry, RestoreEntry
from rolloutlog.errors import InvalidRequest, UnknownEpisode, UnknownRestore
from rolloutlog.projections import CheckpointResult

__all__ = ["router"]

router = APIRouter()

NDJSON_DOC: dict[str, Any] = {"content": {"application/x-ndjson": {}}}
CONFLICT: Responses = {
    409: {"model": ErrorOut, "description": "stale_controller, checkpoint_in_progress"}
}
UNKNOWN: Responses = {404: {"model": ErrorOut, "description": "unknown_run, unknown_checkpoint"}}
RESTORE_UNKNOWN: Responses = {
    404: {"model": ErrorOut, "description": "unknown_run, unknown_restore, unknown_episode"}
}
Limit = Annotated[int, Query(ge=1, le=10_000)]
Before = Annotated[int | None, Query(ge=0, le=2**62)]
RequestIdQuery = Annotated[
    str | None,
    Query(
        pattern=REQUEST_ID_PATTERN,
        description="Only checkpoints begun for this request (the newest answers it).",
    ),
]
KindQuery = Annotated[
    Literal["environment", "policy", "agent", "resources"] | None,
    Query(description="Only projections with something this participant kind restores."),
]
ParticipantQuery = Annotated[
    str | None,
    Query(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$",
        description="Only projections with a session opened by this participant id.",
    ),
]


def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


# -- checkpoints -------------------------------------------------------------------------------


@router.post(
    "/v1/runs/{run}/checkpoints",
    summary="Take a checkpoint (201 committed, 202 still pending)",
    status_code=201,
    response_model=CheckpointOut,
    dependencies=TRAINER,
    responses={**UNKNOWN, **CONFLICT, 202: {"model": CheckpointOut, "description": "pending"}},
)
async def take_checkpoint(request: Request, run: RunPath, body: CheckpointRequest) -> Response:
    service = _service(request)
    with Audited(
        request,
        "checkpoint",
        service.metrics.checkpoint_duration,
        run=run,
        controller_epoch=body.controller_epoch,
        trigger=body.trigger,
    ) as audited:
        result = await service.coordinator.checkpoint(
            run,
            body.controller_epoch,
            deadline_s=body.deadline_s,
            wait=body.wait,
            trigger=body.trigger,
            staging_since=body.staging_keys_since,
            request_id=body.request_id,
        )
        if not isinstance(result, CheckpointResult):
            audited.done("pending", checkpoint_id=result)
            pending = await service.catalog.get_checkpoint(run, result)
            return json_response(checkpoint_view(pending), 202)
        audited.done("committed", result.timings_ms, checkpoint_id=result.checkpoint.checkpoint_id)
    view = checkpoint_view(result.checkpoint, result.staging_keys)
    restaged = result.staging_delta
    if restaged is not None:
        view["staging_keys_since"] = restaged.since
        view["staging_keys_added"] = restaged.added
        view["staging_keys_removed"] = restaged.removed
        view["staging_key_count"] = restaged.count
    view["timings_ms"] = dict(result.timings_ms)
    return json_response(view, 201)


@router.get(
    "/v1/runs/{run}/checkpoints",
    summary="Checkpoints, newest first",
    response_model=CheckpointList,
    dependencies=ANALYST,
    responses=UNKNOWN,
)
async def list_checkpoints(
    request: Request,
    run: RunPath,
    status: Literal["pending", "committed", "aborted", "expired"] | None = None,
    before: Before = None,
    limit: Limit = 100,
    request_id: RequestIdQuery = None,
) -> Response:
    catalog = _service(request).catalog
    await catalog.get_run(run)
    found = await catalog.list_checkpoints(
        run, status=status, before=before, limit=limit, request_id=request_id
    )
    return json_response({"checkpoints": [checkpoint_view(c) for c in found]})


@router.get(
    "/v1/runs/{run}/checkpoints/latest",
    summary="The newest committed checkpoint",
    response_model=CheckpointOut,
    dependencies=ANALYST,
    responses=UNKNOWN,
)
async def latest_checkpoint(request: Request, run: RunPath) -> Response:
    return json_response(checkpoint_view(await _service(request).catalog.latest_checkpoint(run)))


@router.get(
    "/v1/runs/{run}/checkpoints/{checkpoint_id}",
    summary="One checkpoint",
    response_model=CheckpointOut,
    dependencies=ANALYST,
    responses=UNKNOWN,
)
async def get_checkpoint(request: Request, run: RunPath, checkpoint_id: IdPath) -> Response:
    checkpoint = await _service(request).catalog.get_checkpoint(run, checkpoint_id)
    return json_response(checkpoint_view(checkpoint))


async def _manifest(
    service: Service, run: str, checkpoint_id: int, first: list[ManifestEntry], page: int
) -> AsyncIterator[ManifestEntry]:
    batch = first
    while True:
        for entry in batch:
            yield entry
        if len(batch) < page:
            return
        batch = await service.catalog.manifest_page(
            run, checkpoint_id, after=batch[-1].episode, limit=page
        )


@router.get(
    "/v1/runs/{run}/checkpoints/{checkpoint_id}/manifest",
    summary="A committed checkpoint's manifest (NDJSON with Accept: application/x-ndjson)",
    response_model=ManifestOut,
    dependencies=ANALYST,
    responses={**UNKNOWN, 200: NDJSON_DOC},
)
async def get_manifest(request: Request, run: RunPath, checkpoint_id: IdPath) -> Response:
    service = _service(request)
    page = 2000
    # The first page is read before the response starts, so that an unknown or uncommitted
    # checkpoint is a proper 404 rather than an error inside a stream.
    first = await service.catalog.manifest_page(run, checkpoint_id, limit=page)
    entries = _manifest(service, run, checkpoint_id, first, page)
    if wants_ndjson(request):
        return stream_ndjson(entries, manifest_entry_view)
    return stream_json_object(
        {"checkpoint_id": checkpoint_id}, "episodes", entries, manifest_entry_view
    )


# -- restores ----------------------------------------------------------------------------------


@router.post(
    "/v1/runs/{run}/restores",
    summary="Restore from a committed checkpoint (all or nothing)",
    status_code=201,
    response_model=RestoreOut,
    dependencies=TRAINER,
    responses={**RESTORE_UNKNOWN, **CONFLICT},
)
async def restore(request: Request, run: RunPath, body: RestoreRequest) -> Response:
    service = _service(request)
    with Audited(
        request,
        "restore",
        service.metrics.restore_duration,
        run=run,
        controller_epoch=body.controller_epoch,
        checkpoint_id=body.checkpoint_id,
        excluded=len(body.exclude),
    ) as audited:
        result = await service.coordinator.restore(
            run,
            body.controller_epoch,
            body.checkpoint_id,
            exclude=body.exclude,
            policy_version=body.policy_version,
            max_policy_lag=body.max_policy_lag,
            exclude_results=body.exclude_results,
            # The reply goes out while the projector takes the restore's resets (its fold
            # waits for them): the participants' fetch starts sooner.
            settle_after=True,
        )
        audited.done(
            "committed",
            result.timings_ms,
            checkpoint_id=result.restore.checkpoint_id,
            restore_id=result.restore.restore_id,
        )
    service.note_attempts(run, ((e.episode, e.attempt) for e in result.entries))
    service.metrics.count_cuts(result.cuts)
    view = restore_view(result.restore)
    view["timings_ms"] = dict(result.timings_ms)
    return json_response(view, 201)


@router.get(
    "/v1/runs/{run}/restores",
    summary="Restores, newest first",
    response_model=RestoreList,
    dependencies=ANALYST,
    responses=UNKNOWN,
)
async def list_restores(
    request: Request, run: RunPath, before: Before = None, limit: Limit = 100
) -> Response:
    catalog = _service(request).catalog
    await catalog.get_run(run)
    found = await catalog.list_restores(run, before=before, limit=limit)
    return json_response({"restores": [restore_view(r) for r in found]})


async def _restore_entries(
    service: Service, run: str, restore_id: int, action: Any
) -> AsyncIterator[RestoreEntry]:
    after: str | None = None
    while True:
        page = await service.catalog.restore_episodes(
            run, restore_id, action=action, after=after, limit=2000
        )
        for entry in page:
            yield entry
        if len(page) < 2000:
            return
        after = page[-1].episode


RestoreAction = Annotated[Literal["continue", "restart", "excluded"] | None, Query()]


@router.get(
    "/v1/runs/{run}/restores/{restore_id}",
    summary="A restore with its episodes",
    response_model=RestoreDetail,
    dependencies=ANALYST,
    responses=RESTORE_UNKNOWN,
)
async def get_restore(request: Request, run: RunPath, restore_id: IdPath) -> Response:
    service = _service(request)
    found = await service.catalog.get_restore(run, restore_id)
    entries = _restore_entries(service, run, restore_id, None)
    return stream_json_object(restore_view(found), "episodes", entries, restore_entry_view)


@router.get(
    "/v1/runs/{run}/restores/{restore_id}/episodes",
    summary="A restore's episodes (NDJSON with Accept: application/x-ndjson)",
    response_model=RestoreEpisodes,
    dependencies=ANALYST,
    responses={**RESTORE_UNKNOWN, 200: NDJSON_DOC},
)
async def restore_episodes(
    request: Request, run: RunPath, restore_id: IdPath, action: RestoreAction = None
) -> Response:
    service = _service(request)
    await service.catalog.get_restore(run, restore_id)
    entries = _restore_entries(service, run, restore_id, action)
    if wants_ndjson(request):
        return stream_ndjson(entries, restore_entry_view)
    return stream_json_object({"restore_id": restore_id}, "episodes", entries, restore_entry_view)


# -- projections -------------------------------------------------------------------------------


async def _restore_id(service: Service, run: str, value: str) -> int:
    if value == "latest":
        latest = await service.catalog.list_restores(run, limit=1)
        if not latest:
            await service.catalog.get_run(run)
            raise UnknownRestore(f"run {run!r} has no restore yet", run=run)
        return latest[0].restore_id
    if not value.isdigit() or len(value) > 18:
        raise InvalidRequest('restore must be a restore id or "latest"', field="restore")
    return int(value)


@router.get(
    "/v1/runs/{run}/episodes/{episode}/projection",
    summary="One episode's projection, as a restore continues it (or at a checkpoint's cut)",
    response_model=ProjectionOut,
    dependencies=PARTICIPANT,
    responses=RESTORE_UNKNOWN,
)
async def episode_projection(
    request: Request,
    run: RunPath,
    episode: EpisodePath,
    restore: Annotated[
        str | None,
        Query(max_length=20, description='A restore id, or "latest".'),
    ] = None,
    checkpoint: Annotated[int | None, Query(ge=0, le=2**62)] = None,
) -> Response:
    service = _service(request)
    if (restore is None) == (checkpoint is None):
        raise InvalidRequest("give exactly one of restore=ID and checkpoint=ID", field="restore")
    if checkpoint is not None:
        with span("rolloutlog.projection", {"rolloutlog.checkpoint_id": checkpoint}):
            projection = await service.coordinator.checkpoint_projection(run, checkpoint, episode)
        return json_response(projection.to_json())
    assert restore is not None
    restore_id = await _restore_id(service, run, restore)
    with span("rolloutlog.projections", {"rolloutlog.restore_id": restore_id}):
        lines = await service.coordinator.restore_projection_lines(run, restore_id)
        projections = await lines.complete()
    service.metrics.count_served_cuts(run, restore_id, projections.values())
    found = projections.get(episode)
    if found is None:
        raise await _not_continued(service, run, restore_id, episode)
    return Response(found.line[:-1], media_type=JSON)


async def _not_continued(
    service: Service, run: str, restore_id: int, episode: str
) -> UnknownEpisode:
    """Why a restore has no projection of an episode: restarted, excluded, or not in it."""
    async for entry in _restore_entries(service, run, restore_id, None):
        if entry.episode == episode:
            return UnknownEpisode(
                f"restore {restore_id} does not continue episode {episode!r}: it is "
                f"{entry.action} as attempt {entry.attempt}",
                run=run,
                restore_id=restore_id,
                episode=episode,
                action=entry.action,
                attempt=entry.attempt,
                capture_key=entry.capture_key,
                reason=entry.reason,
            )
    return UnknownEpisode(
        f"restore {restore_id} of run {run!r} has no episode {episode!r}",
        run=run,
        restore_id=restore_id,
        episode=episode,
    )


@router.get(
    "/v1/runs/{run}/restores/{restore_id}/projections",
    summary="Every continued episode's projection for one participant (NDJSON)",
    dependencies=PARTICIPANT,
    responses={
        **RESTORE_UNKNOWN,
        200: {"content": {"application/x-ndjson": {}}, "description": "ProjectionOut per line"},
    },
)
async def restore_projections(
    request: Request,
    run: RunPath,
    restore_id: IdPath,
    kind: KindQuery = None,
    participant: ParticipantQuery = None,
) -> Response:
    if participant is not None and kind in ("environment", "policy"):
        raise InvalidRequest(
            f"participant= filters sessions; {kind} projections name no participant",
            field="participant",
        )
    service = _service(request)
    with span("rolloutlog.projections", {"rolloutlog.restore_id": restore_id}):
        # Checked before the response starts (an unknown restore is a 404); then each
        # projection's line is sent as soon as it is built (in no fixed order).
        lines = await service.coordinator.restore_projection_lines(run, restore_id)

    async def selected() -> AsyncIterator[bytes | memoryview]:
        async for batch in lines.batches():
            for line in batch:
                if line.matches(kind, participant):
                    for piece in line.pieces:
                        yield piece
        service.metrics.count_served_cuts(run, restore_id, lines.lines)

    return stream_ndjson_lines(selected())
