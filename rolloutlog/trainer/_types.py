"""What the trainer client returns, and the errors it raises (the service's own error classes,
rebuilt by ``rolloutlog.errors.error_from_wire``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from rolloutlog.errors import RolloutlogError, ServiceError, error_from_body, error_from_wire

__all__ = [
    "CheckpointInfo",
    "EpisodeResult",
    "RestoreEpisode",
    "RestoreInfo",
    "ServiceError",
    "error_from_body",
    "error_from_response",
]


def error_from_response(response: httpx.Response) -> RolloutlogError:
    """The error of an ``httpx`` error reply (``rolloutlog.errors.error_from_wire``)."""
    return error_from_wire(response.status_code, response.content)


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint as the service reports it."""

    checkpoint_id: int
    status: str
    counts: Mapping[str, int]
    offsets: tuple[Mapping[str, Any], ...] = ()
    staging_keys: tuple[str, ...] | None = None
    timings_ms: Mapping[str, float] = field(default_factory=dict)
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> CheckpointInfo:
        keys = body.get("staging_keys")
        return cls(
            checkpoint_id=int(body["checkpoint_id"]),
            status=str(body["status"]),
            counts=dict(body.get("counts", {})),
            offsets=tuple(body.get("offsets", ())),
            staging_keys=tuple(keys) if keys is not None else None,
            timings_ms=dict(body.get("timings_ms", {})),
            raw=dict(body),
        )


@dataclass(frozen=True)
class RestoreEpisode:
    """One episode of a restore plan."""

    episode: str
    previous_attempt: int
    attempt: int
    capture_key: str
    action: str
    reason: str | None = None

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RestoreEpisode:
        return cls(
            episode=str(body["episode"]),
            previous_attempt=int(body["previous_attempt"]),
            attempt=int(body["attempt"]),
            capture_key=str(body["capture_key"]),
            action=str(body["action"]),
            reason=body.get("reason"),
        )


@dataclass(frozen=True)
class RestoreInfo:
    """A committed restore (``episodes`` only when fetched with them)."""

    restore_id: int
    checkpoint_id: int
    counts: Mapping[str, int]
    timings_ms: Mapping[str, float] = field(default_factory=dict)
    episodes: tuple[RestoreEpisode, ...] | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RestoreInfo:
        episodes = body.get("episodes")
        return cls(
            restore_id=int(body["restore_id"]),
            checkpoint_id=int(body["checkpoint_id"]),
            counts=dict(body.get("counts", {})),
            timings_ms=dict(body.get("timings_ms", {})),
            episodes=(
                tuple(RestoreEpisode.from_json(e) for e in episodes)
                if episodes is not None
                else None
            ),
            raw={k: v for k, v in body.items() if k != "episodes"},
        )


@dataclass(frozen=True)
class EpisodeResult:
    """A finished episode's result as the service keeps it (``GET /v1/runs/{run}/results``):
    ``result`` is the environment's opaque result, decoded."""

    episode: str
    attempt: int
    capture_key: str
    reward: float | None
    result: Any
    finished_offset: int
    ts: float
    partition: int | None = None
    acknowledged: bool = False

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> EpisodeResult:
        reward = body.get("reward")
        return cls(
            episode=str(body["episode"]),
            attempt=int(body["attempt"]),
            capture_key=str(body["capture_key"]),
            reward=float(reward) if reward is not None else None,
            result=body.get("result"),
            finished_offset=int(body["finished_offset"]),
            ts=float(body["ts"]),
            partition=body.get("partition"),
            acknowledged=bool(body.get("acknowledged", False)),
        )
