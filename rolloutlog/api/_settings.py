"""The service's settings, each declared once: its field, default, help, flag and variable.

``Settings`` is what ``create_app`` takes. Every field declared with ``setting(...)`` is also a
``rolloutlog serve`` flag and a ``ROLLOUTLOG_*`` variable: ``_config.ServeConfig`` (the
environment, ``*_FILE`` files, validation) and ``cli/_serve.py`` (the click options, ``--help``)
are generated from ``SETTINGS``, so a setting added here is settable everywhere, under one name.

A setting's name (``Setting.name``) is what its flag and variable are made of: ``--keep-committed``
and ``ROLLOUTLOG_KEEP_COMMITTED`` for ``keep_committed``. Where the field keeps another name, or a
unit other than the flag's (``max_events_bytes`` is set in MiB as ``--max-body-mb``), both are
said here, beside the field, and nowhere else.

Kept free of heavy imports: the CLI builds ``serve``'s options from this module without the
server extra installed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutlog.api._env import SECRET_SETTINGS, env_name
from rolloutlog.api._tokens import Tokens
from rolloutlog.errors import ConfigurationError

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "LOG_LEVELS", "SETTINGS", "Setting", "Settings"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8750
DEFAULT_DATA_DIR = Path("rolloutlog-data")
#: The service's log levels (``serve --log-level``), least verbose last.
LOG_LEVELS = ("debug", "info", "warning", "error")
MIB = 1024 * 1024


@dataclass(frozen=True)
class Setting:
    """How one field of ``Settings`` is set from outside: its flag, variable and checks."""

    #: The field of ``Settings`` it sets (filled in from the field).
    field: str
    #: The name its flag and variable are made of (the field's, unless the field says another).
    name: str
    help: str
    #: The Python type of the flag's value (``int``, ``float``, ``str``, ``Path``, ``bool``).
    kind: type
    default: Any
    #: The flag's spelling when it is not ``--`` + the name with dashes (``--log`` for ``log_url``).
    flag: str | None = None
    metavar: str | None = None
    #: The field holds the flag's value times this (MiB given, bytes kept).
    scale: int = 1
    #: Bounds the value must keep (pydantic's ``ge``/``gt``/``le``).
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    min_length: int | None = None
    max_length: int | None = None
    #: The values a string may take (shown in ``--help``).
    choices: tuple[str, ...] | None = None
    #: ``--help``'s default when the default is computed at start (``None`` in the field).
    shown_default: str | None = None

    @property
    def option(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def variable(self) -> str:
        return env_name(self.name)

    @property
    def secret(self) -> bool:
        """Read from ``<variable>_FILE`` too, and never echoed in an error."""
        return self.name in SECRET_SETTINGS

    @property
    def flag_default(self) -> Any:
        """The default in the flag's unit."""
        if self.scale != 1 and isinstance(self.default, int):
            return self.default // self.scale
        return self.default

    def value(self, given: Any) -> Any:
        """The field's value for a value given in the flag's unit."""
        return given * self.scale if self.scale != 1 and given is not None else given


def setting(
    default: Any,
    help: str,
    *,
    kind: type,
    name: str | None = None,
    **options: Any,
) -> Any:
    """A field of ``Settings`` that ``serve`` sets: its default, help and how it is spelt."""
    return field(default=default, metadata={"setting": (name, help, kind, options)})


@dataclass(frozen=True)
class Settings:
    """Everything the service runs with. ``log_url``/``catalog_url`` default to the embedded
    log and a SQLite catalog under ``data_dir``."""

    data_dir: Path = setting(
        DEFAULT_DATA_DIR, "Directory of the embedded log and the SQLite catalog.", kind=Path
    )
    host: str = setting(
        DEFAULT_HOST, "Address to listen on; a non-loopback one needs tokens.", kind=str
    )
    port: int = setting(DEFAULT_PORT, "Port to listen on.", kind=int, ge=0, le=65535)
    log_url: str | None = setting(
        None,
        "Log URL: kafka://HOST:PORT[,HOST:PORT…] or embedded:///DIR",
        kind=str,
        flag="--log",
        metavar="URL",
        shown_default="embedded under the data directory",
    )
    #: TLS and SASL of the Kafka log's connections (README, Security); each may also be given
    #: in the log URL's query under its name without ``kafka_`` (the setting wins).
    kafka_security_protocol: str | None = setting(
        None,
        "Kafka: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL.",
        kind=str,
        metavar="PROTOCOL",
        shown_default="PLAINTEXT",
    )
    kafka_sasl_mechanism: str | None = setting(
        None,
        "Kafka SASL: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512.",
        kind=str,
        metavar="MECHANISM",
        shown_default="PLAIN",
    )
    kafka_sasl_username: str | None = setting(None, "Kafka SASL user name.", kind=str)
    kafka_sasl_password: str | None = setting(None, "Kafka SASL password.", kind=str)
    kafka_ssl_cafile: Path | None = setting(
        None,
        "PEM file of the CAs that sign the Kafka brokers' certificates.",
        kind=Path,
        metavar="FILE",
        shown_default="the system's CAs",
    )
    kafka_ssl_certfile: Path | None = setting(
        None, "PEM file of this client's certificate (mutual TLS).", kind=Path, metavar="FILE"
    )
    kafka_ssl_keyfile: Path | None = setting(
        None, "PEM file of the client certificate's private key.", kind=Path, metavar="FILE"
    )
    catalog_url: str | None = setting(
        None,
        "Catalog URL: postgresql://USER:PASSWORD@HOST/DB (also postgres://, "
        "postgresql+asyncpg://) or sqlite+aiosqlite:///PATH; TLS: ?sslmode=verify-full"
        "&sslrootcert=FILE",
        kind=str,
        flag="--catalog",
        metavar="URL",
        shown_default="SQLite under the data directory",
    )
    #: The tokens the service checks: ``tokens_file``'s and the ``ROLLOUTLOG_TOKEN_<ROLE>``
    #: variables' (``Tokens.load``), or those given to ``create_app``.
    tokens: Tokens = field(default_factory=Tokens)
    tokens_file: Path | None = setting(
        None,
        "JSON (.json) or TOML file of bearer tokens per role; ROLLOUTLOG_TOKEN_<ROLE> "
        "variables add to it.",
        kind=Path,
        name="tokens",
        metavar="FILE",
    )
    #: ``/metrics`` needs a token of the analyst role (a trainer's or admin's too), and shows
    #: a token scoped to some runs only their series; ``/readyz`` names a run only to a token
    #: that holds the analyst role for it. Off: both open to anyone, every run named.
    metrics_auth: bool = setting(
        False,
        "/metrics needs an analyst token (a scoped one sees its runs' series only; anonymous: "
        "401) and /readyz names runs only to a token that reads them.",
        kind=bool,
    )
    log_level: str = setting(
        "info",
        "Least severe log record written (JSON lines on stderr).",
        kind=str,
        choices=LOG_LEVELS,
    )
    access_log: bool = setting(False, "Log every request.", kind=bool)
    #: Largest body ``POST …/events`` accepts (streamed; refused at the limit with 413).
    max_events_bytes: int = setting(
        32 * MIB, "Largest append body, in MiB.", kind=int, name="max_body_mb", scale=MIB, gt=0
    )
    #: Largest body any other route accepts.
    max_request_bytes: int = setting(
        4 * MIB,
        "Largest body of any other route, in MiB.",
        kind=int,
        name="max_request_mb",
        scale=MIB,
        gt=0,
    )
    #: Committed checkpoints kept per run (older ones expire).
    keep_committed: int = setting(2, "Committed checkpoints kept per run.", kind=int, gt=0)
    #: Processes that validate and encode append bodies (0: in the service's own process).
    validation_workers: int = setting(
        0,
        "Processes that validate and encode appends (0: the service's own).",
        kind=int,
        ge=0,
    )
    #: Longest a graceful shutdown waits for in-flight requests (appends drained included).
    drain_timeout_s: float = setting(
        30.0,
        "Seconds a graceful stop waits for in-flight requests.",
        kind=float,
        name="shutdown_timeout",
        ge=0,
    )
    #: A connection must deliver a request's complete headers within this many seconds of its
    #: first byte (or of the connection's opening); otherwise it is closed (``408``).
    header_timeout_s: float = setting(
        10.0,
        "Seconds a request's headers may take (then 408).",
        kind=float,
        name="header_timeout",
        gt=0,
    )
    #: A request body may go this long without a new chunk before it is refused (``408``) and its
    #: connection closed.
    body_timeout_s: float = setting(
        30.0,
        "Seconds a request body may stall (then 408); also the grace of --min-body-rate.",
        kind=float,
        name="body_timeout",
        gt=0,
    )
    #: A request body must also arrive at this many bytes a second on average, past a grace of
    #: ``body_timeout_s``: the time the service waits for it may not pass ``body_timeout_s`` plus
    #: one second per this many bytes received, or it is refused (``408``) and its connection
    #: closed (a body trickled a byte at a time holds no append slot for long); and an append
    #: that finds every slot taken takes the slot of the slowest body below it (``_bodies``).
    #: 0: no minimum.
    min_body_rate: int = setting(
        4096,
        "Bytes a second a request body must average once --body-timeout has passed (then "
        "408); 0: no minimum.",
        kind=int,
        metavar="BYTES",
        ge=0,
    )
    #: Open connections the service keeps at most; None: half the open-file limit (which
    #: ``serve`` raises to its hard limit at start). See ``_protocol``.
    max_connections: int | None = setting(
        None,
        "Open connections kept at most",
        kind=int,
        metavar="N",
        gt=0,
        shown_default="half the open-file limit, which is raised to its hard limit at start",
    )
    #: Of ``max_connections``, kept for ``/healthz``, ``/readyz`` and the trainer's routes
    #: (checkpoints, restores, the controller); at most a quarter of the cap.
    reserved_connections: int = setting(
        32,
        "Connections of the cap kept for /healthz, /readyz and the trainer's routes "
        "(checkpoints, restores, controller); at most a quarter of the cap.",
        kind=int,
        metavar="N",
        ge=0,
    )
    #: Appends processed at once (body read included); one more is refused at once with
    #: ``503 unavailable`` (retriable): a bound on the memory that bodies in flight can take.
    max_inflight_appends: int = setting(
        64, "Appends processed at once; one more is refused with 503.", kind=int, gt=0
    )
    #: An event whose ``seq`` lies more than this past the highest its participant epoch has
    #: appended through this service is refused (``invalid_event``): see docs/api.md, fencing.
    max_seq_gap: int = setting(
        1 << 20,
        "Largest jump of an event's seq past the highest its participant epoch appended "
        "through this service (further is refused: invalid_event).",
        kind=int,
        gt=0,
    )
    #: This replica's name in the catalog's partition leases; None: ``<host>:<port>`` (the
    #: host alone with the embedded log), resolved by ``serve``.
    replica_id: str | None = setting(
        None,
        "This replica's name in the catalog's partition leases; replicas of one service "
        "(one log and catalog) need distinct names, and a restart under the same name takes its "
        "partitions back at once",
        kind=str,
        metavar="NAME",
        min_length=1,
        max_length=200,
        shown_default="HOST:PORT; with the embedded log, HOST",
    )
    #: Where this replica serves (``host:port``), shown to operators beside its leases.
    address: str | None = None
    #: Seconds a replica's leases outlive its last heartbeat; None: the coordinator's default.
    lease_s: float | None = setting(
        None,
        "How long a replica's partitions outlive its last heartbeat (sent every quarter of "
        "it): a dead replica's partitions move to the others within this",
        kind=float,
        metavar="SECONDS",
        gt=0,
        shown_default="6",
    )

    @property
    def resolved_log_url(self) -> str:
        return self.log_url or f"embedded://{Path(self.data_dir).resolve()}"

    @property
    def log_options(self) -> dict[str, Any]:
        """The ``kafka_*`` settings given, as the Kafka log's options (``open_log``)."""
        given = {
            name.removeprefix("kafka_"): str(getattr(self, name))
            for name in _KAFKA_SETTINGS
            if getattr(self, name) is not None
        }
        if given and self.embedded_log:
            raise ConfigurationError(
                f"{', '.join(sorted('--kafka-' + k.replace('_', '-') for k in given))}: "
                "settings of a kafka:// log, given with the embedded one"
            )
        return given

    @property
    def resolved_catalog_url(self) -> str:
        if self.catalog_url:
            return self.catalog_url
        return f"sqlite+aiosqlite:///{Path(self.data_dir).resolve() / 'catalog.sqlite3'}"

    @property
    def embedded_log(self) -> bool:
        """Whether the log is the embedded one (as ``open_log`` decides from the URL)."""
        url = self.log_url or ""
        return "://" not in url or url.startswith("embedded://")

    @classmethod
    def from_settings(cls, values: Mapping[str, Any], **fields: Any) -> Settings:
        """``Settings`` from values keyed by setting name, in the flags' units."""
        by_setting = {s.field: s.value(values[s.name]) for s in SETTINGS if s.name in values}
        return cls(**by_setting, **fields)


def _declared() -> tuple[Setting, ...]:
    settings = []
    for f in dataclasses.fields(Settings):
        if "setting" not in f.metadata:
            continue
        name, help_text, kind, options = f.metadata["setting"]
        settings.append(
            Setting(f.name, name or f.name, help_text, kind, f.default, **dict(options))
        )
    return tuple(settings)


#: Every setting ``serve`` takes, in ``--help``'s order.
SETTINGS: tuple[Setting, ...] = _declared()
_KAFKA_SETTINGS = tuple(f.name for f in dataclasses.fields(Settings) if f.name.startswith("kafka_"))
