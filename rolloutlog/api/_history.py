"""Analysts' reads: one episode's history across attempts, one event's payload, and
how far the projector trails the log. Read-only; every route needs the analyst role."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response

from rolloutlog.api._auth import ANALYST, runs_known
from rolloutlog.api._forks import episode_origin, mark_source_attempts
from rolloutlog.api._http import json_response
from rolloutlog.api._models import (
    EpisodeHistoryOut,
    EpisodePath,
    ErrorOut,
    EventOut,
    ProjectorOut,
    Responses,
    RunPath,
)
from rolloutlog.api._results import result_view
from rolloutlog.api._service import Service
from rolloutlog.api._views import manifest_entry_view, restore_entry_view
from rolloutlog.catalog import Episode, ManifestEntry, RestoreEntry
from rolloutlog.core import resumed_boundary
from rolloutlog.errors import UnknownEpisode
from rolloutlog.log import PAYLOAD_FIELD, capture_key, split_record

__all__ = ["explain", "router"]

router = APIRouter()

NOT_FOUND: Responses = {404: {"model": ErrorOut, "description": "unknown_run, unknown_episode"}}
#: Payload fields never shown in a timeline (they may be megabytes; fetch one event for them).
_PAYLOADS = frozenset(PAYLOAD_FIELD.values())
#: At most this many of an episode's records are read for one history (a page of the timeline
#: is cut from them; attempts, ledger and generation calls are summarized over all of them).
SCAN_LIMIT = 50_000


def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


def _timeline_event(
    offset: int, meta: dict[str, Any], payload: bytes | None, size: int
) -> dict[str, Any]:
    data = {k: v for k, v in (meta.get("data") or {}).items() if k not in _PAYLOADS}
    participant = meta.get("participant") or {}
    return {
        "offset": offset,
        "type": meta.get("type"),
        "attempt": meta.get("attempt", 0),
        "step": meta.get("step"),
        "participant": participant.get("id"),
        "kind": participant.get("kind"),
        "epoch": participant.get("epoch"),
        "seq": meta.get("seq"),
        "ts": meta.get("ts"),
        "stage": data.get("stage"),
        "size_bytes": size,
        "payload_bytes": len(payload) if payload is not None else 0,
        "data": data,
    }


def explain(
    entry: RestoreEntry,
    checkpoint_id: int,
    manifest: ManifestEntry | None,
    events: Sequence[dict[str, Any]],
) -> str:
    """A sentence saying why a restore did what it did to an episode, from what the catalog
    recorded, completed from the episode's events where the recorded reason is terse."""
    if entry.action == "excluded":
        return entry.reason or (
            "excluded by the restore request (the trainer listed it in exclude=); it gets no "
            "new attempt"
        )
    if entry.action == "continue":
        cut = f" at offset {manifest.cut_offset}" if manifest is not None else ""
        stage = f", last stage {manifest.last_stage!r}" if manifest and manifest.last_stage else ""
        return (
            f"continued from checkpoint {checkpoint_id}'s cut{cut}{stage}: attempt "
            f"{entry.attempt} resumes where attempt {entry.previous_attempt} was"
        )
    reason = entry.reason or "no reason was recorded"
    if manifest is None or entry.reason != "the checkpoint's manifest says restart":
        return f"restarted from scratch as attempt {entry.attempt}: {reason}"
    # The manifest records the action, not its cause: find the cause in the events before the cut.
    before = [
        e
        for e in events
        if e["offset"] < manifest.cut_offset and e["attempt"] == entry.previous_attempt
    ]
    open_sessions: dict[str, str] = {}
    for event in before:
        session = event["data"].get("session_id")
        if event["type"] == "session.started" and event["data"].get("mode") == "restart_only":
            open_sessions[session] = event["participant"] or "?"
        elif event["type"] == "session.ended":
            open_sessions.pop(session, None)
    if open_sessions:
        session, owner = next(iter(open_sessions.items()))
        cause = (
            f"a restart_only session ({session!r} of {owner}) was open at checkpoint "
            f"{checkpoint_id}'s cut, and such a session cannot be resumed"
        )
    elif not before:
        cause = f"the attempt had recorded nothing before checkpoint {checkpoint_id}'s cut"
    else:
        cause = f"checkpoint {checkpoint_id}'s manifest marked it restart"
    return f"restarted from scratch as attempt {entry.attempt}: {cause}"


def _attempts(
    episode: str,
    events: Sequence[dict[str, Any]],
    plans: dict[int, tuple[int, int, RestoreEntry, str]],
    records: Sequence[tuple[int, dict[str, Any]]],
    committed_restores: set[int],
) -> list[dict[str, Any]]:
    """Each attempt: how and why it began, the boundary a continued one resumed from (where the
    restore transition left it: ``resumed_boundary`` over the episode's ``records``, as
    ``(offset, metadata)``), its events."""
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        by_attempt.setdefault(event["attempt"], []).append(event)
    numbers = sorted(set(by_attempt) | set(plans) | {0})
    attempts = []
    for number in numbers:
        own = by_attempt.get(number, [])
        first = own[0] if own else None
        view: dict[str, Any] = {
            "attempt": number,
            "capture_key": capture_key(episode, number),
            "events": len(own),
            "first_offset": first["offset"] if first else None,
            "last_offset": own[-1]["offset"] if own else None,
            "started_at": first["ts"] if first else None,
            "began_with": first["type"] if first else None,
            "started_by": (first["participant"] if first else None),
            "finished": any(e["type"] == "episode.finished" for e in own),
            "restore_id": None,
            "checkpoint_id": None,
            "action": None,
            "why": "the first attempt: the environment started the episode",
            "resumed_from": None,
        }
        plan = plans.get(number)
        if plan is not None:
            restore_id, checkpoint_id, entry, why = plan
            view.update(
                restore_id=restore_id,
                checkpoint_id=checkpoint_id,
                action=entry.action,
                why=f"restore {restore_id} (from checkpoint {checkpoint_id}): {why}",
            )
            started = next((e for e in own if e["type"] == "attempt.started"), None)
            cut = started["data"].get("cut") if started is not None else None
            if entry.action == "continue" and started is not None and cut is not None:
                found = resumed_boundary(records, started["offset"], committed_restores)
                boundary = found[1] if found is not None else None
                view["resumed_from"] = {
                    "cut_offset": cut,
                    "boundary_offset": found[0] if found is not None else None,
                    "stage": boundary["data"].get("stage") if boundary else None,
                    "next": boundary["data"].get("next") if boundary else None,
                    "owner": boundary["data"].get("owner") if boundary else None,
                    "step": boundary.get("step") if boundary else None,
                }
        attempts.append(view)
    return attempts


def _ledger(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = ("call_id", "parent_call_id", "prev_len", "cum_len", "policy_version", "digest")
    return [
        {"offset": e["offset"], "attempt": e["attempt"], **{k: e["data"].get(k) for k in keep}}
        for e in events
        if e["type"] == "ledger.row"
    ]


def _generation_calls(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Generation calls by their chunks; a call with no ``done`` chunk was cut in flight."""
    calls: dict[tuple[int, str], dict[str, Any]] = {}
    for e in events:
        if e["type"] != "generation.chunk":
            continue
        key = (e["attempt"], str(e["data"].get("call_id")))
        call = calls.get(key)
        if call is None:
            call = calls[key] = {
                "call_id": key[1],
                "attempt": key[0],
                "parent_call_id": e["data"].get("parent_call_id"),
                "policy_version": e["data"].get("policy_version"),
                "chunks": 0,
                "first_offset": e["offset"],
                "last_offset": e["offset"],
                "last_start": 0,
                "done": False,
            }
        call["chunks"] += 1
        call["last_offset"] = e["offset"]
        call["last_start"] = e["data"].get("start", 0)
        call["done"] = call["done"] or bool(e["data"].get("done"))
    return list(calls.values())


async def _catalog_episode(service: Service, run: str, episode: str) -> Episode | None:
    try:
        return await service.catalog.get_episode(run, episode)
    except UnknownEpisode:
        return None


After = Annotated[int | None, Query(ge=-1, le=2**62, description="Timeline after this offset.")]
Limit = Annotated[int, Query(ge=1, le=10_000, description="Timeline events per page.")]


@router.get(
    "/v1/runs/{run}/episodes/{episode}",
    summary="One episode's history: attempts, manifest and plan entries, event timeline",
    response_model=EpisodeHistoryOut,
    dependencies=ANALYST,
    responses=NOT_FOUND,
)
async def episode_history(
    request: Request, run: RunPath, episode: EpisodePath, after: After = None, limit: Limit = 500
) -> Response:
    service = _service(request)
    coordinator = service.coordinator
    recorded = await _catalog_episode(service, run, episode)
    start = recorded.first_offset if recorded and recorded.first_offset is not None else 0
    partition, records, truncated_at = await coordinator.episode_records(
        run, episode, start=start, limit=SCAN_LIMIT
    )
    tracked = coordinator.tracked_episode(run, episode)
    plan_entries = await service.catalog.episode_plan_entries(run, episode)
    if recorded is None and tracked is None and not records and not plan_entries:
        raise UnknownEpisode(f"run {run!r} has no episode {episode!r}", run=run, episode=episode)
    decoded = [(offset, *split_record(record), len(record)) for offset, record in records]
    events = [_timeline_event(*one) for one in decoded]
    manifests = await service.catalog.episode_manifest_entries(run, episode, partition)
    manifest_of = dict(manifests)
    restores: list[dict[str, Any]] = []
    plans: dict[int, tuple[int, int, RestoreEntry, str]] = {}
    for restore_id, entry in plan_entries:
        checkpoint_id = (await service.catalog.get_restore(run, restore_id)).checkpoint_id
        why = explain(entry, checkpoint_id, manifest_of.get(checkpoint_id), events)
        restores.append(
            {
                "restore_id": restore_id,
                "checkpoint_id": checkpoint_id,
                **restore_entry_view(entry),
                "explanation": why,
            }
        )
        if entry.action != "excluded":
            plans[entry.attempt] = (restore_id, checkpoint_id, entry, why)
    found = await service.catalog.results_page(run, episodes=[episode], limit=1)
    status = recorded.status if recorded is not None else None
    if tracked is not None and status is None:
        status = "finished" if tracked[1] else "running"
    current = max(
        [recorded.current_attempt if recorded else 0, tracked[0] if tracked else 0]
        + [e.attempt for _, e in plan_entries]
    )
    origin = await episode_origin(service.catalog, run, recorded, await runs_known(request))
    page = [e for e in events if after is None or e["offset"] > after][:limit]
    more = len(page) == limit and page[-1]["offset"] != events[-1]["offset"]
    return json_response(
        {
            "run": run,
            "episode": episode,
            "partition": partition,
            "status": status,
            "current_attempt": current,
            "capture_key": capture_key(episode, current),
            "live": tracked is not None and not tracked[1],
            "started_at": recorded.started_at if recorded else None,
            "finished_at": recorded.finished_at if recorded else None,
            "result": result_view(found[0]) if found else None,
            "forked_from": origin,
            "attempts": mark_source_attempts(
                _attempts(
                    episode,
                    events,
                    plans,
                    [(offset, meta) for offset, meta, _, _ in decoded],
                    {restore_id for restore_id, _ in plan_entries},
                ),
                origin,
            ),
            "checkpoints": [
                {
                    "checkpoint_id": checkpoint_id,
                    **manifest_entry_view(entry),
                    "size_bytes": entry.size_bytes,
                }
                for checkpoint_id, entry in manifests
            ],
            "restores": restores,
            "ledger": _ledger(events),
            "generation_calls": _generation_calls(events),
            "event_count": len(events),
            "events": page,
            "next_after": page[-1]["offset"] if more else None,
            "scan_truncated_at": truncated_at,
        }
    )


@router.get(
    "/v1/runs/{run}/episodes/{episode}/events/{offset}",
    summary="One event of an episode in full, payload included",
    response_model=EventOut,
    dependencies=ANALYST,
    responses=NOT_FOUND,
)
async def episode_event(
    request: Request,
    run: RunPath,
    episode: EpisodePath,
    offset: Annotated[int, Path(ge=0, le=2**62, description="The event's offset.")],
) -> Response:
    coordinator = _service(request).coordinator
    partition, records, _ = await coordinator.episode_records(
        run, episode, start=offset, end=offset + 1, limit=1
    )
    if not records or records[0][0] != offset:
        raise UnknownEpisode(
            f"episode {episode!r} has no event at offset {offset} of partition {partition}",
            run=run,
            episode=episode,
            offset=offset,
        )
    meta, payload = split_record(records[0][1])
    if payload is not None:
        field = PAYLOAD_FIELD[meta["type"]]
        meta.setdefault("data", {})[field] = orjson.Fragment(payload)
    return json_response({"partition": partition, "offset": offset, "event": meta})


@router.get(
    "/v1/runs/{run}/projector",
    summary="How far this service's projector trails the log, per partition it folds, and "
    "which replica folds each partition",
    response_model=ProjectorOut,
    dependencies=ANALYST,
    responses={404: {"model": ErrorOut, "description": "unknown_run"}},
)
async def projector_lag(request: Request, run: RunPath) -> Response:
    coordinator = _service(request).coordinator
    lags = await coordinator.projector_lag(run)
    partitions = [
        {"partition": p, "end_offset": end, "applied": applied, "lag": end - applied}
        for p, end, applied in lags
    ]
    owners = [
        {
            "partition": o.partition,
            "replica_id": o.replica_id,
            "generation": o.generation,
            "live": o.live,
        }
        for o in await coordinator.partition_owners(run)
    ]
    return json_response(
        {
            "run": run,
            "at": time.time(),
            "log_records": sum(end for _, end, _ in lags),
            "lag": sum(p["lag"] for p in partitions),
            "partitions": partitions,
            "replica_id": coordinator.replica_id,
            "owners": owners,
        }
    )
