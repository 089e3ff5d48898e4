"""``python -m rolloutlog.participants.sim ROLE …``: run one simulated participant server.

Roles: ``policy``, ``agent``, ``resources`` (``--mode exported|stateless|restart_only``),
``environment``. The ``Gym`` launcher starts them; run one by hand like this::

    python -m rolloutlog.participants.sim policy --port 8801 --service-url http://127.0.0.1:8750 \\
        --run sim --id policy-0
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
    parser.add_argument("--policy-url")
    parser.add_argument("--agent-url")
    parser.add_argument(
        "--resources", action="append", default=[], metavar="KIND=URL", help="a resources server"
    )
    parser.add_argument("--mode", choices=["restart_only", "stateless", "exported", "sandbox"])
    parser.add_argument("--verify", choices=["replay", "wait"], default="replay")
    parser.add_argument("--verify-delay", type=float, default=0.0, help="seconds")
    parser.add_argument("--token-rate", type=float, default=2000.0, help="tokens per second")
    parser.add_argument("--chunk-tokens", type=int, default=16)
    parser.add_argument("--policy-version", type=int, default=1)
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
        policy_url=args.policy_url,
        agent_url=args.agent_url,
        resources_urls=dict(item.split("=", 1) for item in args.resources),
        mode=args.mode or "restart_only",
        verify=args.verify,
        verify_delay_s=args.verify_delay,
        token_rate=args.token_rate,
        chunk_tokens=args.chunk_tokens,
        policy_version=args.policy_version,
        skip_restore=args.skip_restore,
    )


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn
    from starlette.types import ASGIApp

    settings = parse(sys.argv[1:] if argv is None else argv)
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
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=settings.port,
        log_level="warning",
        access_log=False,
        # well past httpx's 5 s keep-alive expiry: the client drops an idle connection before
        # the server does, so a request never races the server closing it (a ReadError)
        timeout_keep_alive=120,
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
