"""Structured logs: one JSON object per line on stderr.

Besides the service's own records: ``rolloutlog.access``, one line per request (``Observe``:
method, route, status, duration, request id, trace id; on with ``serve --access-log``), and
``rolloutlog.audit``, one line per checkpoint and restore (``audit``: who, what, outcome,
duration; always on). uvicorn's own access log stays off: ours replaces it."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

__all__ = ["JsonFormatter", "audit", "configure_logging", "uvicorn_log_config"]

audit_logger = logging.getLogger("rolloutlog.audit")

_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "color_message"}
)


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "message", …extra fields, "exc"?}``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(level: str = "info") -> None:
    """Send every logger's records to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def uvicorn_log_config(level: str = "info", access_log: bool = False) -> dict[str, Any]:
    """uvicorn's loggers, formatted as JSON like the service's own."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            # Replaced by rolloutlog.access (structured, with the route and the request id).
            "uvicorn.access": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
            "rolloutlog": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "rolloutlog.access": {"level": "INFO" if access_log else "WARNING"},
            "rolloutlog.audit": {"level": "INFO"},
        },
    }


def audit(action: str, outcome: str, duration_s: float, who: dict[str, Any], **what: Any) -> None:
    """One audit line: ``{"audit": action, "outcome", "duration_ms", "who", …what}``."""
    audit_logger.info(
        "%s %s",
        action,
        outcome,
        extra={
            "audit": action,
            "outcome": outcome,
            "duration_ms": round(duration_s * 1000, 3),
            "who": who,
            **what,
        },
    )
