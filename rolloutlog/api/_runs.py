"""Routes of runs, participants, the controller, episodes and statistics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import Response

from rolloutlog.api._auth import (
    ANALYST,
    PARTICIPANT,
    TRAINER,
    Role,
    authorize_runs,
    runs_known,
    runs_of,
)
from rolloutlog.api._forks import create_fork, fork_view, forked_from_view
from rolloutlog.api._http import json_response, stream_ndjson, wants_ndjson
from rolloutlog.api._models import (
    ControllerOut,
    ControllerRequest,
    CreateRun,
    DeletedRunOut,
    EpisodeList,
    ErrorOut,
    ParticipantList,
    ParticipantOut,
    RegisterParticipant,
    Responses,
    RunList,
    RunOut,
    RunPath,
    StatsOut,
)
from rolloutlog.api._service import Service
from rolloutlog.api._tokens import RunScope
from rolloutlog.api._views import episode_view, participant_view, run_view, tracked_view
from rolloutlog.catalog import Episode, RunSummary
from rolloutlog.errors import RunExists, UnknownRun
from rolloutlog.projections import RunHealthReport, summarize_health

__all__ = ["router"]

router = APIRouter()

NOT_FOUND: Responses = {404: {"model": ErrorOut, "description": "unknown_run"}}
Limit = Annotated[int, Query(ge=1, le=10_000)]
After = Annotated[str | None, Query(max_length=200)]


def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


def _live(service: Service, run: str) -> int | None:
    return service.coordinator.live_episode_count(run)


def _run_out(
    service: Service,
    summary: RunSummary,
    health: Mapping[str, RunHealthReport],
    shown: RunScope,
) -> dict[str, Any]:
    """A run's view with its health across replicas (``health``: from ``runs_health``): which
    partitions and replicas hold it back, and this replica's own projector (``local``); a
    fork's source is named if the token holds it (``shown``)."""
    run = summary.run.run
    coordinator = service.coordinator
    report = health.get(run)
    if report is None:  # nobody folds it yet, nothing has failed
        report = summarize_health([], None)
    view = report.view(coordinator.replica_id)
    if view["since"] is None:
        view["since"] = summary.run.created_at
    return {
        **run_view(summary, _live(service, run)),
        "health": view,
        "forked_from": forked_from_view(summary.run, shown),
    }


@router.post(
    "/v1/runs",
    summary="Create a run (idempotent with the same settings)",
    status_code=201,
    response_model=RunOut,
    dependencies=TRAINER,
    responses={
        200: {"model": RunOut, "description": "the run existed with the same settings"},
        409: {"model": ErrorOut, "description": "run_exists (other settings)"},
    },
)
async def create_run(request: Request, body: CreateRun) -> Response:
    # A fork reads its source's checkpoint: the token holds the trainer role on both.
    forked_from = [body.fork.run] if body.fork is not None else []
    await authorize_runs(request, Role.TRAINER, [body.run, *forked_from])
    service = _service(request)
    if body.fork is not None:
        return await create_fork(service, body)
    try:
        await service.catalog.get_run(body.run)
        existed = True
    except UnknownRun:
        existed = False
    try:
        partitions = await service.coordinator.create_run(body.run, body.partitions)
    except RunExists as e:
        hidden = await _source_hidden(request, e)
        if hidden is None:
            raise
        raise hidden from e
    return json_response({"run": body.run, "partitions": partitions}, 200 if existed else 201)


async def _source_hidden(request: Request, refusal: RunExists) -> RunExists | None:
    """A name being forked is refused naming the fork's source only to a token that holds a
    role on the source (as ``forked_from`` does): the refusal without it, or None to keep
    ``refusal`` as it is."""
    existing = refusal.details.get("settings", {}).get("fork", {}).get("existing") or {}
    source = existing.get("run")
    if not refusal.details.get("being_forked") or source is None:
        return None
    if (await runs_known(request)).covers(source):
        return None
    return RunExists(
        f"run {refusal.details.get('run')!r} is being created as a fork",
        **{
            **refusal.details,
            "settings": {"fork": {"existing": {**existing, "run": None}, "requested": None}},
        },
    )


@router.get("/v1/runs", summary="Runs with counts", response_model=RunList, dependencies=ANALYST)
async def list_runs(request: Request, after: After = None, limit: Limit = 100) -> Response:
    service = _service(request)
    summaries = await _visible_runs(service, await runs_of(request, Role.ANALYST), after, limit)
    health = await service.coordinator.runs_health()
    shown = await runs_known(request)
    return json_response(
        {
            "runs": [_run_out(service, s, health, shown) for s in summaries],
            "next_after": summaries[-1].run.run if len(summaries) == limit else None,
        }
    )


async def _visible_runs(
    service: Service, scope: RunScope, after: str | None, limit: int
) -> list[RunSummary]:
    """A page of the runs ``scope`` covers, in name order."""
    keep = None if scope.every else scope.covers
    return await service.catalog.list_runs(after=after, limit=limit, keep=keep)


@router.get(
    "/v1/runs/{run}",
    summary="One run with counts",
    response_model=RunOut,
    dependencies=ANALYST,
    responses=NOT_FOUND,
)
async def get_run(request: Request, run: RunPath) -> Response:
    service = _service(request)
    summary = await service.catalog.run_summary(run)
    health = await service.coordinator.runs_health(run)
    scope = await runs_of(request, Role.ANALYST)  # the forks the token may see
    forks = [fork_view(f) for f in await service.catalog.forks_of(run) if scope.covers(f.run)]
    view = _run_out(service, summary, health, await runs_known(request))
    return json_response({**view, "forks": forks})


@router.delete(
    "/v1/runs/{run}",
    summary="Delete a run: its log, catalog rows and the service's resources for it",
    response_model=DeletedRunOut,
    dependencies=TRAINER,
    responses=NOT_FOUND,
)
async def delete_run(request: Request, run: RunPath) -> Response:
    service = _service(request)
    if not await service.coordinator.delete_run(run):
        raise UnknownRun(f"no run {run!r}", run=run)
    service.forget_run(run)
    return json_response({"run": run, "deleted": True})


@router.post(
    "/v1/runs/{run}/participants",
    summary="Register a participant (returns its new epoch)",
    status_code=201,
    response_model=ParticipantOut,
    dependencies=PARTICIPANT,
    responses=NOT_FOUND,
)
async def register_participant(
    request: Request, run: RunPath, body: RegisterParticipant
) -> Response:
    service = _service(request)
    epoch = await service.catalog.register_participant(run, body.id, body.kind)
    service.note_epoch(run, body.id, epoch)
    return json_response({"id": body.id, "kind": body.kind, "epoch": epoch}, 201)


@router.get(
    "/v1/runs/{run}/participants",
    summary="Registered participants",
    response_model=ParticipantList,
    dependencies=ANALYST,
    responses=NOT_FOUND,
)
async def list_participants(request: Request, run: RunPath) -> Response:
    participants = await _service(request).catalog.list_participants(run)
    return json_response({"participants": [participant_view(p) for p in participants]})


@router.post(
    "/v1/runs/{run}/controller",
    summary="Take over the run's controller (older epochs become stale)",
    response_model=ControllerOut,
    dependencies=TRAINER,
    responses={
        **NOT_FOUND,
        409: {"model": ErrorOut, "description": "stale_controller (expected_epoch)"},
    },
)
async def take_over_controller(
    request: Request, run: RunPath, body: Annotated[ControllerRequest | None, Body()] = None
) -> Response:
    expected = body.expected_epoch if body is not None else None
    epoch = await _service(request).catalog.take_over_controller(run, expected_epoch=expected)
    return json_response({"controller_epoch": epoch})


async def _catalog_episodes(
    service: Service, run: str, status: Any, after: str | None, limit: int | None
) -> list[Episode]:
    """Catalog episodes in id order after ``after`` (``limit=None``: all of them)."""
    found: list[Episode] = []
    while limit is None or len(found) < limit:
        page_size = 2000 if limit is None else min(limit - len(found), 2000)
        page = await service.catalog.list_episodes(run, status=status, after=after, limit=page_size)
        found.extend(page)
        if len(page) < page_size:
            break
        after = page[-1].episode
    return found


def _merged(
    service: Service,
    run: str,
    recorded: list[Episode],
    status: str | None,
    after: str | None,
    limit: int | None,
) -> list[dict[str, Any]]:
    """The catalog's episodes joined with those the projector tracks but the catalog has not
    recorded yet (it learns of episodes at restores), in id order."""
    tracked = {e.episode: e for e in service.coordinator.tracked_episodes(run)}
    views: dict[str, dict[str, Any]] = {}
    for episode in recorded:
        known = tracked.get(episode.episode)
        views[episode.episode] = episode_view(episode, known is not None and not known.finished)
    last = recorded[-1].episode if limit is not None and len(recorded) == limit else None
    for name, known in tracked.items():
        if name in views or (after is not None and name <= after):
            continue
        if last is not None and name > last:
            continue  # beyond this page of the catalog: the next page has it
        if status is not None and status != known.status:
            continue
        views[name] = tracked_view(known)
    ordered = [views[name] for name in sorted(views)]
    return ordered if limit is None else ordered[:limit]


@router.get(
    "/v1/runs/{run}/episodes",
    summary="Episodes with status (paged JSON, or all as NDJSON)",
    response_model=EpisodeList,
    dependencies=ANALYST,
    responses={
        **NOT_FOUND,
        200: {"content": {"application/x-ndjson": {}}, "description": "EpisodeOut per line"},
    },
)
async def list_episodes(
    request: Request,
    run: RunPath,
    status: Literal["running", "finished", "excluded"] | None = None,
    after: After = None,
    limit: Limit = 1000,
) -> Response:
    service = _service(request)
    await service.coordinator.follow(run)  # unknown_run, and the live view
    if wants_ndjson(request):
        recorded = await _catalog_episodes(service, run, status, after, None)
        return stream_ndjson(_merged(service, run, recorded, status, after, None))
    recorded = await _catalog_episodes(service, run, status, after, limit)
    page = _merged(service, run, recorded, status, after, limit)
    next_after = page[-1]["episode"] if len(page) == limit else None
    return json_response({"episodes": page, "next_after": next_after})


@router.get(
    "/v1/runs/{run}/stats",
    summary="Event counts, bytes, checkpoint and restore timings",
    response_model=StatsOut,
    dependencies=ANALYST,
    responses=NOT_FOUND,
)
async def run_stats(request: Request, run: RunPath) -> Response:
    service = _service(request)
    stats = await service.catalog.run_stats(run)
    coordinator = service.coordinator
    await coordinator.follow(run)  # unknown_run, and the live view
    ends = await service.log.latest_offsets(run)  # every replica's records
    live = coordinator.live_episode_count(run) or 0
    restores = await service.catalog.list_restores(run, limit=1)
    return json_response(
        {
            "run": run,
            "participants": stats.participant_count,
            "events": {
                "log_records": sum(ends),
                "log_end_offsets": ends,
                "projector_applied": coordinator.run_events_applied(run),
                "tracked_bytes": coordinator.tracked_bytes(run),
            },
            "episodes": {**stats.episode_counts, "live": live},
            "checkpoints": {
                "counts": dict(stats.checkpoint_counts),
                "latest_checkpoint_id": stats.latest_checkpoint_id,
                "latest_entry_count": stats.latest_entry_count,
                "latest_size_bytes": stats.latest_size_bytes,
                "duration_ms_mean": stats.checkpoint_duration_ms_mean,
                "duration_ms_max": stats.checkpoint_duration_ms_max,
                "duration_ms_last": stats.checkpoint_duration_ms_last,
            },
            "restores": {
                "count": stats.restore_count,
                "last_restore_at": stats.last_restore_at,
                "last_timings_ms": dict(restores[0].timings_ms) if restores else None,
            },
        }
    )
