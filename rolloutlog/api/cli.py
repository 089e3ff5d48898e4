"""The ``rolloutlog`` command: ``serve`` the service, or talk to one (``runs``, ``checkpoint``,
``restore``, ``checkpoints``, ``episodes``).

    rolloutlog serve [--data-dir DIR] [--host H] [--port P] [--log URL] [--catalog URL]
                     [--tokens FILE]
    rolloutlog runs [--url URL] [--token TOKEN] [--json]
    rolloutlog runs delete RUN [--url URL] [--token TOKEN]
    rolloutlog checkpoint RUN [--deadline S] [--no-wait] [--take-over | --epoch N]
    rolloutlog restore RUN [--checkpoint ID|latest] [--exclude EPISODE]... [--episodes]
    rolloutlog checkpoints RUN [--status S]
    rolloutlog episodes RUN [--status S]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from rolloutlog.api._commands import COMMANDS
from rolloutlog.api._settings import DEFAULT_DATA_DIR, DEFAULT_HOST, DEFAULT_PORT, Settings
from rolloutlog.api._tokens import ENV_PREFIX, MIN_TOKEN_LENGTH, Role, Tokens, is_loopback_host
from rolloutlog.errors import RolloutlogError
from rolloutlog.trainer import TrainerClient

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

__all__ = ["GC_THRESHOLDS", "main", "parser"]

#: The garbage collector's thresholds while serving (see ``serve``).
GC_THRESHOLDS = (50_000, 50, 1_000)

#: ``details["backend"]`` of the catalog's errors: a start-up failure names the catalog's URL.
CATALOG_BACKENDS = frozenset({"postgresql", "sqlite"})


def no_tokens_message(host: str) -> str:
    env = ", ".join(ENV_PREFIX + role.value.upper() for role in Role)
    return (
        f"rolloutlog serve: refusing to listen on {host} without tokens: anyone who can reach "
        "that address could append events, take over runs and restore them.\n"
        "Configure bearer tokens (at least "
        f"{MIN_TOKEN_LENGTH} characters each), either\n"
        "  --tokens FILE  with FILE a JSON (.json) or TOML file mapping roles to tokens, e.g.\n"
        '                 {"participant": ["…"], "trainer": "…", "analyst": "…", "admin": "…"}\n'
        f"  or the environment variables {env}\n"
        "     (comma-separated for several tokens per role),\n"
        f"or listen on a loopback address (--host {DEFAULT_HOST})."
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="rolloutlog", description="Event-sourced checkpoint log for RL rollouts."
    )
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the service")
    serve.add_argument(
        "--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="default: %(default)s"
    )
    serve.add_argument("--host", default=DEFAULT_HOST, help="default: %(default)s")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="default: %(default)s")
    serve.add_argument("--log", dest="log_url", help="log URL (default: embedded under DIR)")
    serve.add_argument(
        "--catalog", dest="catalog_url", help="catalog URL (default: SQLite under DIR)"
    )
    serve.add_argument("--tokens", type=Path, help="JSON or TOML file of bearer tokens per role")
    serve.add_argument("--keep-committed", type=_positive_int, default=2, help="checkpoints kept")
    serve.add_argument(
        "--max-body-mb", type=_positive_int, default=32, help="largest append body (MiB)"
    )
    serve.add_argument(
        "--validation-workers",
        type=int,
        default=0,
        help="processes that validate and encode appends (default 0: the service process)",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--access-log", action="store_true", help="log every request")
    serve.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds to finish in-flight requests"
    )
    serve.add_argument(
        "--header-timeout",
        type=_positive_float,
        default=Settings.header_timeout_s,
        help="seconds a request's headers may take (default: %(default)s)",
    )
    serve.add_argument(
        "--body-timeout",
        type=_positive_float,
        default=Settings.body_timeout_s,
        help="seconds a request body may stall (default: %(default)s)",
    )
    serve.add_argument(
        "--max-inflight-appends",
        type=_positive_int,
        default=Settings.max_inflight_appends,
        help="appends processed at once; more get 503 (default: %(default)s)",
    )

    def client_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--url",
            default=os.environ.get("ROLLOUTLOG_URL", f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"),
            help="service URL (env ROLLOUTLOG_URL; default: %(default)s)",
        )
        sub.add_argument(
            "--token",
            default=os.environ.get("ROLLOUTLOG_TOKEN"),
            help="bearer token (env ROLLOUTLOG_TOKEN)",
        )
        sub.add_argument("--json", action="store_true", help="machine-readable output")

    def controller_options(sub: argparse.ArgumentParser) -> None:
        group = sub.add_mutually_exclusive_group()
        group.add_argument("--take-over", action="store_true", help="take over the controller")
        group.add_argument("--epoch", type=int, help="controller epoch (default: the current one)")

    runs = commands.add_parser("runs", help="list runs, or delete one (runs delete RUN)")
    runs.add_argument("action", nargs="?", choices=["list", "delete"], default="list")
    runs.add_argument("run", nargs="?", help="the run to delete")
    client_options(runs)

    checkpoint = commands.add_parser("checkpoint", help="take a checkpoint")
    checkpoint.add_argument("run")
    checkpoint.add_argument("--deadline", type=float, help="seconds to wait for open wait steps")
    checkpoint.add_argument("--no-wait", action="store_true", help="return while still pending")
    checkpoint.add_argument(
        "--no-wait-for-commit", action="store_true", help="do not poll a pending checkpoint"
    )
    controller_options(checkpoint)
    client_options(checkpoint)

    restore = commands.add_parser("restore", help="restore a run from a checkpoint")
    restore.add_argument("run")
    restore.add_argument("--checkpoint", default="latest", help="checkpoint id or 'latest'")
    restore.add_argument("--exclude", action="append", help="episode whose result you hold")
    restore.add_argument("--exclude-file", help="file of episode ids to exclude, one per line")
    restore.add_argument("--policy-version", type=int)
    restore.add_argument("--max-policy-lag", type=int)
    restore.add_argument("--episodes", action="store_true", help="list the restored episodes")
    controller_options(restore)
    client_options(restore)

    checkpoints = commands.add_parser("checkpoints", help="list a run's checkpoints")
    checkpoints.add_argument("run")
    checkpoints.add_argument("--status", choices=["pending", "committed", "aborted", "expired"])
    checkpoints.add_argument("--limit", type=_positive_int, default=100)
    client_options(checkpoints)

    episodes = commands.add_parser("episodes", help="list a run's episodes")
    episodes.add_argument("run")
    episodes.add_argument("--status", choices=["running", "finished", "excluded"])
    client_options(episodes)
    return top


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from rolloutlog.api._app import create_app
    from rolloutlog.api._logging import configure_logging, uvicorn_log_config
    from rolloutlog.api._protocol import http_protocol

    try:
        tokens = Tokens.load(args.tokens)
    except RolloutlogError as e:
        print(f"rolloutlog serve: {e.message}", file=sys.stderr)
        return 2
    if not tokens.enabled and not is_loopback_host(args.host):
        print(no_tokens_message(args.host), file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    settings = Settings(
        data_dir=args.data_dir,
        log_url=args.log_url,
        catalog_url=args.catalog_url,
        tokens=tokens,
        keep_committed=args.keep_committed,
        max_events_bytes=args.max_body_mb * 1024 * 1024,
        drain_timeout_s=args.shutdown_timeout,
        validation_workers=max(0, args.validation_workers),
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_inflight_appends=args.max_inflight_appends,
    )
    problem = _data_dir_in_use(settings)
    if problem is not None:
        print(f"rolloutlog serve: {problem}", file=sys.stderr)
        return 1
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        http=http_protocol(settings.header_timeout_s),
        host=args.host,
        port=args.port,
        log_config=uvicorn_log_config(args.log_level, args.access_log),
        access_log=args.access_log,
        timeout_graceful_shutdown=args.shutdown_timeout,
        # The lifespan (opening the log and the catalog) runs in ``_start_then_serve`` before
        # uvicorn starts: a start-up failure is then one line on stderr, not a logged traceback.
        lifespan="off",
        server_header=False,
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
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        if not runner.run(_start_then_serve(app, server, settings, stopped_by)):
            return 1
    return 0 if server.started or stopped_by else 1


async def _start_then_serve(
    app: FastAPI, server: uvicorn.Server, settings: Settings, stopped_by: list[int]
) -> bool:
    """Open the service (the app's lifespan), then serve until a signal; False when it could
    not start, after printing why as one line on stderr."""
    async with contextlib.AsyncExitStack() as stack:
        try:
            await stack.enter_async_context(app.router.lifespan_context(app))
        except Exception as e:  # whatever stopped the start, the operator needs its cause
            print(start_failure_message(e, settings), file=sys.stderr)
            return False
        if not stopped_by:  # a SIGTERM during start-up: stop as soon as it is up
            await server.serve()
    return True


def start_failure_message(error: BaseException, settings: Settings) -> str:
    """One line naming why ``serve`` could not start (and which catalog, when it was that)."""
    if isinstance(error, RolloutlogError):
        cause = error.message
        if error.details.get("backend") in CATALOG_BACKENDS:
            from sqlalchemy.engine import make_url

            url = make_url(settings.resolved_catalog_url).render_as_string(hide_password=True)
            cause += f" (catalog {url})"
    else:
        cause = f"{type(error).__name__}: {error}"
    return "rolloutlog serve: cannot start: " + " ".join(cause.split())


def _data_dir_in_use(settings: Settings) -> str | None:
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
        return e.message
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    command = COMMANDS[args.command]
    try:
        with TrainerClient(args.url, token=args.token) as client:
            return command(client, args, sys.stdout)
    except RolloutlogError as e:
        print(f"rolloutlog {args.command}: {e.code}: {e.message}", file=sys.stderr)
        return 1
    except httpx.HTTPError as e:
        print(f"rolloutlog {args.command}: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
