"""rolloutlog's error tree, and the one place an error reply is turned back into its class.

Every error carries its stable ``code`` (docs/design.md §8), the HTTP status it maps to and whether a
retry may succeed. Driver errors (SQLite, PostgreSQL, Kafka) are translated into these classes at the
boundary where they occur, always with ``raise ... from e``. The clients (the trainer's and the
participant SDK's) rebuild them from the wire with ``error_from_wire`` / ``error_from_body``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import orjson

__all__ = [
    "AttemptFenced",
    "BackendUnavailable",
    "CatalogError",
    "CatalogVersionError",
    "CheckpointInProgress",
    "CheckpointNotPending",
    "ConfigurationError",
    "DataDirLocked",
    "Forbidden",
    "InvalidEvent",
    "InvalidRequest",
    "LeaseLost",
    "LogError",
    "ParticipantFenced",
    "PayloadTooLarge",
    "RequestTimeout",
    "RestoreConflict",
    "RolloutlogError",
    "RunExists",
    "RunLost",
    "ServiceError",
    "StaleController",
    "Unauthorized",
    "UnknownCheckpoint",
    "UnknownEpisode",
    "UnknownRestore",
    "UnknownRun",
    "error_from_body",
    "error_from_wire",
]


class RolloutlogError(Exception):
    """Base of every error rolloutlog raises on purpose."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    retriable: ClassVar[bool] = False

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details

    def to_dict(self) -> dict[str, Any]:
        """The body of the REST error reply: ``{"error": {"code", "message", "details"}}``."""
        return {"error": {"code": self.code, "message": self.message, "details": self.details}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, details={self.details!r})"


class InvalidEvent(RolloutlogError):
    """An event envelope is malformed; ``details`` names the field (and the event's index)."""

    code = "invalid_event"
    http_status = 422


class InvalidRequest(RolloutlogError):
    code = "invalid_request"
    http_status = 400


class ConfigurationError(InvalidRequest):
    """A start-up mistake: a bad backend URL, option, setting or file. The service (or the
    client) cannot start as configured; no request is involved, hence no 4xx of its own.

    A subclass of ``InvalidRequest`` (what these mistakes raised before) so that code catching
    that keeps working."""

    code = "invalid_configuration"
    http_status = 500

    @classmethod
    def missing_extra(cls, needed_by: str, extra: str, error: ImportError) -> ConfigurationError:
        """``needed_by`` needs rolloutlog's ``extra`` extra: ``error`` says a package of it is
        not installed; the message names what to install."""
        return cls(
            f"{needed_by} needs the {extra} extra ({error.name or error} is not installed): "
            f"pip install 'rolloutlog[{extra}]'",
            extra=extra,
        )


class PayloadTooLarge(RolloutlogError):
    code = "payload_too_large"
    http_status = 413


class RequestTimeout(RolloutlogError):
    """A client sent its request's headers or body too slowly; the connection is closed."""

    code = "request_timeout"
    http_status = 408
    retriable = True


class UnknownRun(RolloutlogError):
    code = "unknown_run"
    http_status = 404


class UnknownCheckpoint(RolloutlogError):
    code = "unknown_checkpoint"
    http_status = 404


class UnknownRestore(RolloutlogError):
    code = "unknown_restore"
    http_status = 404


class UnknownEpisode(RolloutlogError):
    code = "unknown_episode"
    http_status = 404


class RunExists(RolloutlogError):
    code = "run_exists"
    http_status = 409


class AttemptFenced(RolloutlogError):
    code = "attempt_fenced"
    http_status = 409


class ParticipantFenced(RolloutlogError):
    code = "participant_fenced"
    http_status = 409


class StaleController(RolloutlogError):
    code = "stale_controller"
    http_status = 409


class CheckpointInProgress(RolloutlogError):
    code = "checkpoint_in_progress"
    http_status = 409
    retriable = True


class CheckpointNotPending(RolloutlogError):
    """A checkpoint operation needs a ``pending`` checkpoint; ``details["status"]`` says what it is."""

    code = "checkpoint_not_pending"
    http_status = 409


class RestoreConflict(RolloutlogError):
    """Another restore of the run committed first; plan again."""

    code = "restore_conflict"
    http_status = 409
    retriable = True


class Unauthorized(RolloutlogError):
    code = "unauthorized"
    http_status = 401


class Forbidden(RolloutlogError):
    code = "forbidden"
    http_status = 403


class BackendUnavailable(RolloutlogError):
    """The log or the catalog could not be reached; the operation had no effect and may be retried."""

    code = "unavailable"
    http_status = 503
    retriable = True


class LeaseLost(BackendUnavailable):
    """A replica wrote for a partition it no longer owns (its lease moved to another replica, at a
    newer generation): the write had no effect. The partition's new owner does the work."""


class DataDirLocked(RolloutlogError):
    """Another process holds the embedded data directory's lock; this one must not start."""

    code = "data_dir_locked"
    http_status = 503


class LogError(RolloutlogError):
    """The log backend failed in a way that is not a connectivity problem."""

    code = "log_error"
    http_status = 500


class CatalogError(RolloutlogError):
    """The catalog failed in a way that is not a connectivity problem."""

    code = "catalog_error"
    http_status = 500


class CatalogVersionError(CatalogError):
    """The catalog's schema is newer than this code understands."""

    code = "catalog_too_new"


class RunLost(LogError):
    """A run's records are gone from the log: its topic vanished, or a partition holds fewer
    records than offsets known to exist (a broker that restarted empty). Retrying cannot bring
    them back; an operator must, and appends to the run are refused meanwhile."""

    code = "run_lost"
    http_status = 503


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
    for name in __all__:
        cls = globals()[name]
        if (
            isinstance(cls, type)
            and issubclass(cls, RolloutlogError)
            and cls is not ServiceError
            and cls.code != "internal"
        ):
            found.setdefault(cls.code, cls)
    return found


def error_from_body(status: int, body: Any) -> RolloutlogError:
    """The rolloutlog error an ``{"error": {"code", "message", "details"}}`` body names (a
    ``ServiceError`` for a code without a class, or a body that is not one)."""
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


def error_from_wire(status: int, content: bytes) -> RolloutlogError:
    """The error of an HTTP reply's status and raw body (JSON, or anything else a proxy sent)."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        body = content[:500].decode(errors="replace")
    return error_from_body(status, body)


_ERRORS = _error_classes()
