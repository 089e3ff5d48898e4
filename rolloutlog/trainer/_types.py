"""What the trainer client returns, and the errors it raises (the service's own error classes)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from rolloutlog import errors
from rolloutlog.errors import RolloutlogError

__all__ = [
    "CheckpointInfo",
    "RestoreEpisode",
    "RestoreInfo",
    "ServiceError",
    "error_from_body",
    "error_from_response",
]


class ServiceError(RolloutlogError):
    """An error reply whose code has no class of its own here (``not_found``, ``internal``…)."""

    def __init__(self, status: int, code: str, message: str, details: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.details = dict(details)
        self.code = code  # type: ignore[misc]
        self.http_status = status  # type: ignore[misc]
        self.retriable = status in (502, 503, 504)  # type: ignore[misc]


def _error_classes() -> dict[str, type[RolloutlogError]]:
    found: dict[str, type[RolloutlogError]] = {}
    for name in errors.__all__:
        cls = getattr(errors, name)
        if isinstance(cls, type) and issubclass(cls, RolloutlogError) and cls.code != "internal":
            found.setdefault(cls.code, cls)
    return found


_ERRORS = _error_classes()


def error_from_body(status: int, body: Any) -> RolloutlogError:
    """The rolloutlog error an ``{"error": {"code", "message", "details"}}`` body names."""
    problem = body.get("error") if isinstance(body, dict) else None
    if not isinstance(problem, dict):
        return ServiceError(status, f"http_{status}", f"HTTP {status}", {"body": body})
    code = str(problem.get("code", f"http_{status}"))
    message = str(problem.get("message", code))
    details = problem.get("details") or {}
    cls = _ERRORS.get(code)
    if cls is None:
        return ServiceError(status, code, message, details)
    error = cls(message)
    error.details = dict(details)
    return error


def error_from_response(response: httpx.Response) -> RolloutlogError:
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        body = response.text[:500]
    return error_from_body(response.status_code, body)


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
