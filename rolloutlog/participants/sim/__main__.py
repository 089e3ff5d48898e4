"""``python -m rolloutlog.participants.sim ROLE …``: run one simulated participant server.

Roles: ``policy``, ``agent``, ``resources`` (``--mode exported|stateless|restart_only``),
``environment``. The ``Gym`` launcher starts them; run one by hand like this::

    python -m rolloutlog.participants.sim policy --port 8801 --service-url http://127.0.0.1:8750 \\
        --run sim --id policy-0

``policy --workers N`` runs N worker processes on the one port (SO_REUSEPORT), each registered
as ``<id>.w<i>``, sharing their ledger rows through a SQLite file (``SharedLedger``), so a
call's parent resolves whichever worker recorded it; ``--worker-ports P0,P1,…`` gives each
worker its own port too (its ``/sim/*`` routes, and an address a round-robin client can use).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rolloutlog.participants.sim._runtime import ServerSettings

ROLES = ("policy", "agent", "resources", "environment")


def parse(argv: Sequence[str]) -> ServerSettings:
    parser = argparse.ArgumentParser(prog="python -m rolloutlog.participants.sim")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--service-url", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--id", required=True, help="participant id (stable across restarts)")
    parser.add_argument("--restore-id", type=int, help="the restore replacement attempts continue")
    parser.add_argument("--transport", choices=["http", "kafka"], default="http")
    parser.add_argument("--log-url", help="kafka://… for --transport kafka")
    parser.add_argument("--token", help="participant bearer token (default: none)")
    parser.add_argument(
        "--policy-url", action="append", default=[], help="the policy (repeat: one per worker)"
    )
    parser.add_argument("--agent-url")
    parser.add_argument(
        "--resources", action="append", default=[], metavar="KIND=URL", help="a resources server"
    )
    parser.add_argument("--mode", choices=["restart_only", "stateless", "exported", "sandbox"])
    parser.add_argument("--verify", choices=["replay", "wait"], default="wait")
    parser.add_argument("--verify-delay", type=float, default=0.0, help="seconds")
    parser.add_argument("--token-rate", type=float, default=2000.0, help="tokens per second")
    parser.add_argument("--chunk-tokens", type=int, default=16)
    parser.add_argument("--policy-version", type=int, default=1)
    parser.add_argument(
        "--fork-policy-version",
        type=int,
        help="the policy version in any other run a rollout names (a fork beside --run)",
    )
    parser.add_argument("--workers", type=int, default=1, help="worker processes (policy)")
    parser.add_argument("--worker-ports", default="", help="P0,P1,…: each worker's own port")
    parser.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ledger-path", help=argparse.SUPPRESS)
    parser.add_argument(
        "--allow-no-rollout-id",
        action="store_true",
        help="pass requests without x-rolloutlog-capture-key through (default: refuse them)",
    )
    parser.add_argument(
        "--skip-restore",
        action="store_true",
        help="negative control: a resources server ignores restored session state",
    )
    args = parser.parse_args(argv)
    return ServerSettings(
        role=args.role,
        participant_id=args.id,
        service_url=args.service_url,
        run=args.run,
        port=args.port,
        restore_id=args.restore_id,
        transport=args.transport,
        log_url=args.log_url,
        token=args.token,
        policy_urls=args.policy_url,
        agent_url=args.agent_url,
        resources_urls=dict(item.split("=", 1) for item in args.resources),
        mode=args.mode or "restart_only",
        verify=args.verify,
        verify_delay_s=args.verify_delay,
        token_rate=args.token_rate,
        chunk_tokens=args.chunk_tokens,
        policy_version=args.policy_version,
        fork_policy_version=args.fork_policy_version,
        skip_restore=args.skip_restore,
        workers=args.workers,
        worker_index=args.worker_index,
        worker_ports=[int(p) for p in args.worker_ports.split(",") if p],
        ledger_path=args.ledger_path,
        rollout_id_required=not args.allow_no_rollout_id,
    )


def main(argv: Sequence[str] | None = None) -> None:
    from starlette.types import ASGIApp

    from rolloutlog.participants.sim._runtime import serve, supervise

    argv = sys.argv[1:] if argv is None else argv
    settings = parse(argv)
    if settings.workers > 1 and settings.worker_index is None:
        if settings.role != "policy":
            raise SystemExit("--workers is for the policy role")
        sys.exit(supervise(argv, settings))
    app: ASGIApp
    if settings.role == "policy":
        from rolloutlog.participants.sim._policy_server import policy_server

        app = policy_server(settings).app
    elif settings.role == "agent":
        from rolloutlog.participants.sim._agent_server import agent_server

        app = agent_server(settings).app
    elif settings.role == "resources":
        from rolloutlog.participants.sim._resources_server import resources_server

        app = resources_server(settings)[1]
    else:
        from rolloutlog.participants.sim._environment_server import environment_server

        app = environment_server(settings).app
    serve(app, settings)


if __name__ == "__main__":
    main()
