"""What the service and its HTTP clients (the trainer's, the participant SDK's) agree on besides
the routes: where the service listens by default and the media type of its streams. Error replies
are turned back into their classes by ``rolloutlog.errors.error_from_wire``."""

from __future__ import annotations

__all__ = ["DEFAULT_URL", "NDJSON"]

#: The service's address when neither the caller nor ``ROLLOUTLOG_URL`` names one.
DEFAULT_URL = "http://127.0.0.1:8750"
#: Newline-delimited JSON: event batches in, episode and projection streams out.
NDJSON = "application/x-ndjson"
