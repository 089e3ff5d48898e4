"""The service's settings: where the log and catalog live, tokens, limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rolloutlog.api._tokens import Tokens

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "LOG_LEVELS", "Settings"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8750
DEFAULT_DATA_DIR = Path("rolloutlog-data")
#: The service's log levels (``serve --log-level``), least verbose last.
LOG_LEVELS = ("debug", "info", "warning", "error")
MIB = 1024 * 1024


@dataclass(frozen=True)
class Settings:
    """Everything ``create_app`` needs. ``log_url``/``catalog_url`` default to the embedded
    log and a SQLite catalog under ``data_dir``."""

    data_dir: Path = DEFAULT_DATA_DIR
    log_url: str | None = None
    catalog_url: str | None = None
    tokens: Tokens = field(default_factory=Tokens)
    #: Largest body ``POST …/events`` accepts (streamed; refused at the limit with 413).
    max_events_bytes: int = 32 * MIB
    #: Largest body any other route accepts.
    max_request_bytes: int = 4 * MIB
    #: Committed checkpoints kept per run (older ones expire).
    keep_committed: int = 2
    #: Processes that validate and encode append bodies (0: in the service's own process).
    validation_workers: int = 0
    #: Longest a graceful shutdown waits for in-flight appends.
    drain_timeout_s: float = 30.0
    #: A connection must deliver a request's complete headers within this many seconds of its
    #: first byte (or of the connection's opening); otherwise it is closed (``408``).
    header_timeout_s: float = 10.0
    #: A request body may go this long without a new chunk before it is refused (``408``) and its
    #: connection closed.
    body_timeout_s: float = 30.0
    #: A request body must also arrive at this many bytes a second on average, past a grace of
    #: ``body_timeout_s``: the time the service waits for it may not pass ``body_timeout_s`` plus
    #: one second per this many bytes received, or it is refused (``408``) and its connection
    #: closed (a body trickled a byte at a time holds no append slot for long); and an append
    #: that finds every slot taken takes the slot of the slowest body below it (``_bodies``).
    #: 0: no minimum.
    min_body_rate: int = 4096
    #: Open connections the service keeps at most; None: half the open-file limit (which
    #: ``serve`` raises to its hard limit at start). See ``_protocol``.
    max_connections: int | None = None
    #: Of ``max_connections``, kept for ``/healthz``, ``/readyz`` and the trainer's routes
    #: (checkpoints, restores, the controller); at most a quarter of the cap.
    reserved_connections: int = 32
    #: Appends processed at once (body read included); one more is refused at once with
    #: ``503 unavailable`` (retriable): a bound on the memory that bodies in flight can take.
    max_inflight_appends: int = 64
    #: An event whose ``seq`` lies more than this past the highest its participant epoch has
    #: appended through this service is refused (``invalid_event``): see docs/api.md, fencing.
    max_seq_gap: int = 1 << 20
    #: This replica's name in the catalog's partition leases (issue 17); None: the host's name.
    replica_id: str | None = None
    #: Where this replica serves (``host:port``), shown to operators beside its leases.
    address: str | None = None
    #: Seconds a replica's leases outlive its last heartbeat; None: the coordinator's default.
    lease_s: float | None = None

    @property
    def resolved_log_url(self) -> str:
        return self.log_url or f"embedded://{Path(self.data_dir).resolve()}"

    @property
    def resolved_catalog_url(self) -> str:
        if self.catalog_url:
            return self.catalog_url
        return f"sqlite+aiosqlite:///{Path(self.data_dir).resolve() / 'catalog.sqlite3'}"
