"""Catalog values → the JSON bodies of docs/design.md §8 (plain dicts for orjson)."""

from __future__ import annotations

from typing import Any

from rolloutlog.catalog import (
    Checkpoint,
    Episode,
    ManifestEntry,
    RegisteredParticipant,
    Restore,
    RestoreEntry,
    RunSummary,
)
from rolloutlog.log import capture_key
from rolloutlog.projections import TrackedEpisode

__all__ = [
    "checkpoint_view",
    "episode_view",
    "manifest_entry_view",
    "tracked_view",
    "participant_view",
    "restore_entry_view",
    "restore_view",
    "run_view",
]


def run_view(summary: RunSummary, live_episodes: int | None = None) -> dict[str, Any]:
    run = summary.run
    counts: dict[str, Any] = {
        "participants": summary.participant_count,
        "checkpoints": dict(summary.checkpoint_counts),
        "restores": summary.restore_count,
        "episodes": summary.episode_count,
    }
    if live_episodes is not None:
        counts["live_episodes"] = live_episodes
    return {
        "run": run.run,
        "partitions": run.partitions,
        "log_url": run.log_url,
        "controller_epoch": run.controller_epoch,
        "latest_checkpoint_id": run.latest_checkpoint_id,
        "created_at": run.created_at,
        "counts": counts,
    }


def participant_view(participant: RegisteredParticipant) -> dict[str, Any]:
    return {
        "id": participant.participant_id,
        "kind": participant.kind,
        "epoch": participant.epoch,
        "registered_at": participant.registered_at,
        "last_seen_at": participant.last_seen_at,
    }


def checkpoint_view(
    checkpoint: Checkpoint, staging_keys: tuple[str, ...] | None = None
) -> dict[str, Any]:
    view: dict[str, Any] = {
        "checkpoint_id": checkpoint.checkpoint_id,
        "status": checkpoint.status,
        "counts": checkpoint.counts,
        "offsets": [
            {"partition": o.partition, "marker": o.marker, "replay_from": o.replay_from}
            for o in checkpoint.offsets
        ],
        "timings_ms": dict(checkpoint.timings_ms),
        "trigger": checkpoint.trigger,
        "controller_epoch": checkpoint.controller_epoch,
        "deadline_s": checkpoint.deadline_s,
        "requested_at": checkpoint.requested_at,
        "marked_at": checkpoint.marked_at,
        "committed_at": checkpoint.committed_at,
        "ended_at": checkpoint.ended_at,
        "entry_count": checkpoint.entry_count,
        "size_bytes": checkpoint.size_bytes,
        "reason": checkpoint.reason,
        "request_id": checkpoint.request_id,
    }
    if staging_keys is not None:
        view["staging_keys"] = staging_keys  # encoded as a JSON array: no copy of ~48,000
    return view


def manifest_entry_view(entry: ManifestEntry) -> dict[str, Any]:
    return {
        "episode": entry.episode,
        "attempt": entry.attempt,
        "capture_key": capture_key(entry.episode, entry.attempt),
        "action": entry.action,
        "cut": {"partition": entry.cut_partition, "offset": entry.cut_offset},
        "last_stage": entry.last_stage,
        "reason": entry.reason,
    }


def restore_view(restore: Restore) -> dict[str, Any]:
    view = {
        "restore_id": restore.restore_id,
        "checkpoint_id": restore.checkpoint_id,
        "counts": restore.counts,
        "controller_epoch": restore.controller_epoch,
        "committed_at": restore.committed_at,
        "timings_ms": dict(restore.timings_ms),
    }
    if restore.unacknowledged_results is not None:
        view["unacknowledged_results"] = restore.unacknowledged_results
    return view


def restore_entry_view(entry: RestoreEntry) -> dict[str, Any]:
    return {
        "episode": entry.episode,
        "previous_attempt": entry.previous_attempt,
        "attempt": entry.attempt,
        "capture_key": capture_key(entry.episode, entry.attempt),
        "action": entry.action,
        "reason": entry.reason,
    }


def tracked_view(episode: TrackedEpisode) -> dict[str, Any]:
    """An episode the projector tracks but the catalog has not recorded yet."""
    return {
        "episode": episode.episode,
        "current_attempt": episode.attempt,
        "capture_key": capture_key(episode.episode, episode.attempt),
        "status": episode.status,
        "live": not episode.finished,
        "first_partition": episode.first_partition,
        "first_offset": episode.first_offset,
        "started_at": episode.started_at,
        "finished_at": None,
        "updated_at": None,
    }


def episode_view(episode: Episode, live: bool) -> dict[str, Any]:
    return {
        "episode": episode.episode,
        "current_attempt": episode.current_attempt,
        "capture_key": capture_key(episode.episode, episode.current_attempt),
        "status": episode.status,
        "live": live,
        "first_partition": episode.first_partition,
        "first_offset": episode.first_offset,
        "started_at": episode.started_at,
        "finished_at": episode.finished_at,
        "updated_at": episode.updated_at,
    }
