"""``rolloutlog serve``: configure (flags > ``ROLLOUTLOG_*`` > ``*_FILE`` > defaults), check
what can be checked before anything opens, then run the service on uvicorn.

A start-up failure is one line on stderr naming its cause and the exit code, and nothing else:
``rolloutlog serve: cannot start: CODE: message (exit N)`` — exit 2 for a configuration mistake
(fix the flags or variables, or install the ``server`` extra), 1 for anything the environment
refused (a database, a broker, a data directory in use, a port taken).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from rolloutlog.api._env import FILE_SUFFIX
from rolloutlog.api._settings import DEFAULT_HOST, SETTINGS, Setting, Settings
from rolloutlog.api._tokens import ENV_PREFIX, MIN_TOKEN_LENGTH, Role
from rolloutlog.api.cli._main import EXIT_OK, EXIT_REFUSED, EXIT_USAGE
from rolloutlog.errors import ConfigurationError, RolloutlogError

if TYPE_CHECKING:
    import socket

    import uvicorn
    from fastapi import FastAPI

    from rolloutlog.api._protocol import ConnectionCap
    from rolloutlog.api._service import Service

__all__ = ["GC_THRESHOLDS", "serve", "start_failure"]

#: The garbage collector's thresholds while serving (see ``run_service``).
GC_THRESHOLDS = (50_000, 50, 1_000)

#: ``details["backend"]`` of the catalog's errors: a start-up failure names the catalog's URL.
CATALOG_BACKENDS = frozenset({"postgresql", "sqlite"})

#: The soft open-file limit ``serve`` asks for under an unlimited hard one (Linux's default
#: ``fs.nr_open``, above which the kernel refuses).
NOFILE_CEILING = 1 << 20


def no_tokens_message(host: str) -> str:
    env = ", ".join(ENV_PREFIX + role.value.upper() for role in Role)
    return (
        f"refusing to listen on {host} without tokens (anyone who can reach that address could "
        "append events, take over runs and restore them): give --tokens FILE (a JSON or TOML file "
        f"mapping roles to tokens of {MIN_TOKEN_LENGTH}+ characters) or set {env} (or their "
        f"{FILE_SUFFIX} variants), or listen on a loopback address (--host {DEFAULT_HOST})"
    )


def start_failure(code: str, message: str, exit_code: int) -> int:
    """Print the one line of a failed start and return its exit code."""
    line = f"rolloutlog serve: cannot start: {code}: {message} (exit {exit_code})"
    print(" ".join(line.split()), file=sys.stderr)
    return exit_code


def _option(setting: Setting) -> Callable[[Any], Any]:
    """``setting``'s flag; its variable is read by ``ServeConfig``, named here for ``--help``."""
    names = setting.variable
    if setting.secret:
        names += f", {setting.variable}{FILE_SUFFIX}"
    kw: dict[str, Any] = {"metavar": setting.metavar}
    if setting.kind is bool:
        kw["is_flag"] = True
    elif setting.choices is not None:
        kw["type"] = click.Choice(setting.choices)
    elif setting.kind is Path:
        kw["type"] = click.Path(path_type=Path)
    else:
        kw["type"] = setting.kind
    help_text = setting.help
    if setting.shown_default is not None:
        help_text += f" [default: {setting.shown_default}]"
    return click.option(
        setting.option,
        setting.name,
        default=setting.flag_default,
        show_default=setting.shown_default is None and setting.default is not None,
        help=f"{help_text} [env var: {names}]",
        **kw,
    )


def _options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Every setting's flag (``_settings.SETTINGS``), in its order."""
    for setting in reversed(SETTINGS):
        command = _option(setting)(command)
    return command


@click.command()
@_options
@click.pass_context
def serve(ctx: click.Context, /, **flags: Any) -> int:
    """Run the service (REST API, projector, checkpoints and restores).

    Every flag can also come from its ROLLOUTLOG_* variable; the log and catalog URLs also from
    a file named by ROLLOUTLOG_LOG_URL_FILE / ROLLOUTLOG_CATALOG_URL_FILE (Docker secrets).
    Precedence: flag, then variable, then *_FILE, then default.

    \b
    Exit codes: 0 stopped by SIGTERM/SIGINT; 1 could not start (a backend, the data
    directory or the port refused); 2 a configuration mistake.
    """
    given = {
        name: value
        for name, value in flags.items()
        if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
    }
    flag_names = {p.name: p.opts[0] for p in ctx.command.params if p.name}
    try:
        return run_service(given, flag_names)
    except ModuleNotFoundError as e:
        missing = missing_server_package(e)
        if missing is None:
            raise
        return start_failure(missing.code, missing.message, EXIT_USAGE)


def missing_server_package(error: BaseException) -> ConfigurationError | None:
    """The start-up failure of a service whose packages (the ``server`` extra) are not
    installed: ``pip install rolloutlog`` is the participant SDK and the clients only."""
    if not isinstance(error, ModuleNotFoundError) or error.name is None:
        return None
    if error.name.partition(".")[0] == "rolloutlog":
        return None  # a module of rolloutlog's own is missing: a broken checkout, not an extra
    return ConfigurationError.missing_extra("the service", "server", error)


def run_service(given: Mapping[str, Any], flag_names: Mapping[str, str]) -> int:
    """Configure, check and run the service; its exit code."""
    from rolloutlog.api._config import ServeConfig
    from rolloutlog.api._tokens import is_loopback_host

    try:
        settings = ServeConfig.load(given, flag_names).settings()
    except ConfigurationError as e:
        return start_failure(e.code, e.message, EXIT_USAGE)
    if not settings.tokens.enabled and not is_loopback_host(settings.host):
        return start_failure(ConfigurationError.code, no_tokens_message(settings.host), EXIT_USAGE)
    locked = _data_dir_in_use(settings)
    if locked is not None:
        return start_failure(locked.code, locked.message, EXIT_REFUSED)
    try:
        listener = _listen(settings.host, settings.port)
    except OSError as e:
        where = f"{settings.host}:{settings.port}"
        return start_failure("cannot_listen", f"{where}: {e.strerror or e}", EXIT_REFUSED)
    with listener:
        return _serve(settings, listener)


def _serve(settings: Settings, listener: socket.socket) -> int:
    import asyncio
    import faulthandler
    import gc
    import math
    import signal

    import uvicorn

    from rolloutlog._malloc import fix_mmap_threshold, limit_arenas
    from rolloutlog.api._app import create_app
    from rolloutlog.api._logging import configure_logging, uvicorn_log_config
    from rolloutlog.api._protocol import http_protocol
    from rolloutlog.wire import SERVICE_KEEPALIVE_S

    limit_arenas()  # before any thread of the service starts (rolloutlog/_malloc.py)
    fix_mmap_threshold()
    configure_logging(settings.log_level)
    # Before the log sizes its reader pool by the limit; said once the service is up (a failed
    # start is one line).
    cap, limits_line = _open_file_limit(settings)
    app = create_app(settings)

    def refused(code: str) -> None:
        service: Service | None = getattr(app.state, "service", None)
        if service is not None:
            service.metrics.refusals.labels(code).inc()

    config = uvicorn.Config(
        app,
        http=http_protocol(settings.header_timeout_s, cap, refused),
        backlog=cap.backlog,
        log_config=uvicorn_log_config(settings.log_level, settings.access_log),
        access_log=settings.access_log,
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s),
        # The lifespan (opening the log and the catalog) runs in ``_start_then_serve`` before
        # uvicorn starts: a start-up failure is then one line on stderr, not a logged traceback.
        lifespan="off",
        server_header=False,
        # The clients (``wire.CLIENT_KEEPALIVE_S``) let idle connections go before this.
        timeout_keep_alive=SERVICE_KEEPALIVE_S,
    )
    server = uvicorn.Server(config)
    # An append allocates thousands of short-lived objects (envelopes, records, the projector's
    # decoded metadata); with the default thresholds (700, 10, 10) the collector ran every few
    # requests and walked the projector's trackers each time. Measured: ~7k -> ~10k events/s.
    gc.set_threshold(*GC_THRESHOLDS)
    # uvicorn handles SIGTERM/SIGINT itself (stop accepting, finish in-flight requests, run the
    # lifespan's shutdown), then re-raises the signal with the handlers it found. These make
    # that last step a no-op, so a graceful stop exits 0 rather than dying by the signal.
    stopped_by: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda number, frame: stopped_by.append(number))
    # SIGUSR2 prints every thread's stack to stderr and the service goes on: what a stop (or
    # anything else) that does not end is waiting for.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        failed = runner.run(
            _start_then_serve(app, server, settings, listener, stopped_by, limits_line)
        )
    if failed is not None:
        return failed
    return EXIT_OK if server.started or stopped_by else EXIT_REFUSED


async def _start_then_serve(
    app: FastAPI,
    server: uvicorn.Server,
    settings: Settings,
    listener: socket.socket,
    stopped_by: list[int],
    started: Callable[[], None],
) -> int | None:
    """Open the service (the app's lifespan), then serve until a signal; the exit code when it
    could not start, after printing why."""
    import contextlib

    async with contextlib.AsyncExitStack() as stack:
        try:
            await stack.enter_async_context(app.router.lifespan_context(app))
        except Exception as e:  # whatever stopped the start, the operator needs its cause
            return start_failure(*_failure(e, settings))
        started()
        if not stopped_by:  # a SIGTERM during start-up: stop as soon as it is up
            await server.serve(sockets=[listener])
    return None


def _open_file_limit(settings: Settings) -> tuple[ConnectionCap, Callable[[], None]]:
    """Raise the soft open-file limit to the hard one (connections, the log's files and the
    catalog's all hold descriptors; the common soft limit of 1,024 is a default, not a
    choice), and the connection cap under it; and the log line that says both."""
    import functools
    import logging
    import resource

    from rolloutlog.api._protocol import connection_cap

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit is not a soft one Linux takes: its own ceiling (nr_open) is 2^20.
    wanted = hard if hard != resource.RLIM_INFINITY else NOFILE_CEILING
    raised = soft
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    done = f"open-file limit {soft} kept (the hard limit is {hard_text})"
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as e:
            done = f"open-file limit {soft} kept: raising it to {wanted} failed ({e})"
        else:
            raised = wanted
            done = f"open-file limit raised from {soft} to {raised} (hard limit {hard_text})"
    nofile = raised if raised != resource.RLIM_INFINITY else NOFILE_CEILING
    cap = connection_cap(nofile, settings.max_connections, settings.reserved_connections)
    line = functools.partial(
        logging.getLogger("rolloutlog.api").info,
        "%s; at most %d connections, %d of them kept for health checks and trainers",
        done,
        cap.max_connections,
        cap.reserved,
        extra={
            "nofile_before": soft,
            "nofile": raised,
            "nofile_hard": hard,
            "max_connections": cap.max_connections,
            "reserved_connections": cap.reserved,
            "backlog": cap.backlog,
        },
    )
    return cap, line


def _failure(error: BaseException, settings: Settings) -> tuple[str, str, int]:
    """Code, cause (naming the catalog, when it was that) and exit code of a failed start."""
    error = missing_server_package(error) or error
    if not isinstance(error, RolloutlogError):
        return "internal", f"{type(error).__name__}: {error}", EXIT_REFUSED
    cause = error.message
    if error.details.get("backend") in CATALOG_BACKENDS:
        from sqlalchemy.engine import make_url

        url = make_url(settings.resolved_catalog_url).render_as_string(hide_password=True)
        cause += f" (catalog {url})"
    local = isinstance(error, ConfigurationError)
    return error.code, cause, EXIT_USAGE if local else EXIT_REFUSED


def _listen(host: str, port: int) -> socket.socket:
    """The service's socket, bound before the log and catalog open: a port already taken
    fails the start at once, before a catalog migration or a log recovery ran for nothing."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family=family)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _data_dir_in_use(settings: Settings) -> RolloutlogError | None:
    """Why the embedded data directory cannot be ours, before anything opens it. The log takes
    the lock for good when the service starts (a process that wins the race in between makes
    that start fail instead, still before the catalog is touched)."""
    url = settings.resolved_log_url
    if not url.startswith("embedded://"):
        return None
    from rolloutlog.log import DataDirLock
    from rolloutlog.log.embedded import from_url

    try:
        DataDirLock.acquire(from_url(url).data_dir).release()
    except RolloutlogError as e:
        return e
    return None
