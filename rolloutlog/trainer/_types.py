"""What the trainer client returns, and the errors it raises (the service's own error classes,
rebuilt by ``rolloutlog.errors.error_from_wire``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
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


class StagingKeys:
    """Per run, the staging keys of the newest checkpoint the client took: its next checkpoint
    request names that checkpoint (``staging_keys_since``), and a reply that says only what
    changed from it (``staging_keys_added``/``_removed``, see docs/api.md) is composed with them,
    so a checkpoint's reply costs what changed, not every live rollout's keys."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, set[str]]] = {}

    def since(self, run: str) -> int | None:
        held = self._held.get(run)
        return held[0] if held is not None else None

    def info(self, run: str, body: Mapping[str, Any]) -> CheckpointInfo:
        """The reply of a checkpoint request for ``run``, with every staging key listed."""
        held = self._held.pop(run, None)
        added = body.get("staging_keys_added")
        if added is None:
            info = CheckpointInfo.from_json(body)
            if info.staging_keys is not None:
                self._held[run] = (info.checkpoint_id, set(info.staging_keys))
            elif held is not None:  # pending: the next one may still amend the held keys
                self._held[run] = held
            return info
        since = body.get("staging_keys_since")
        if held is None or held[0] != since:
            raise _inconsistent(
                run,
                f"checkpoint {body.get('checkpoint_id')} of run {run!r}: the service sent the "
                f"staging keys changed since checkpoint {since}, whose keys this client does not "
                "hold",
            )
        keys = held[1]
        keys.difference_update(body.get("staging_keys_removed") or ())
        keys.update(added)
        if len(keys) != body.get("staging_key_count"):
            raise _inconsistent(
                run,
                f"checkpoint {body.get('checkpoint_id')} of run {run!r}: {len(keys)} staging "
                f"keys composed, the service counts {body.get('staging_key_count')}",
            )
        info = replace(CheckpointInfo.from_json(body), staging_keys=tuple(keys))
        self._held[run] = (info.checkpoint_id, keys)
        return info


def _inconsistent(run: str, message: str) -> ServiceError:
    """A delta reply this client cannot compose: the checkpoint committed, but its staging keys
    are unknown here (the next checkpoint's reply lists them all again)."""
    return ServiceError(500, "internal", message, {"run": run})


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
