"""``python -m rolloutlog.integrations.nemo_gym``: launch, overlay, serve, collect, venv.
``--help`` on each says more."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson


def _launch(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf  # type: ignore[import-not-found,unused-ignore]

    from rolloutlog.integrations.nemo_gym._launcher import Launcher, resolve_config

    config = resolve_config(args.config, args.override)
    if args.resolved:
        Path(args.resolved).write_text(OmegaConf.to_yaml(config))
    launcher = Launcher(
        config,
        only=args.only or None,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        state_path=Path(args.state) if args.state else None,
        head=not args.no_head,
    )
    launcher.start()
    names = ", ".join(f"{n} {s.url}" for n, s in launcher.servers.items())
    print(f"NeMo Gym servers ready: {names}; head server {launcher.head_url}", flush=True)
    return launcher.run_forever()


def _overlay(args: argparse.Namespace) -> int:
    from rolloutlog.integrations.nemo_gym._launcher import plain_config, resolve_config
    from rolloutlog.integrations.nemo_gym._ng_run import write_overlay

    directory = Path(args.dir).resolve()
    written = write_overlay(plain_config(resolve_config(args.config, args.override)), directory)
    print("\n".join(str(path) for path in written))
    configs = ",".join(str(Path(c).resolve()) for c in args.config)
    print(
        f'then: cd {directory} && ng_run "+config_paths=[{configs}]" '
        f"+skip_venv_if_present=true +uv_venv_dir={directory}"
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from rolloutlog.integrations.nemo_gym._launcher import serve

    serve(args.name)
    return 0


def _agent_urls(args: argparse.Namespace, names: set[str]) -> dict[str, str]:
    urls = dict(item.split("=", 1) for item in args.agent_url)
    missing = names - set(urls)
    if not missing:
        return urls
    try:
        import yaml  # type: ignore[import-untyped,unused-ignore]
    except ImportError as e:  # NeMo Gym's venv has it (OmegaConf's); a trainer's may not
        raise SystemExit(
            f"collect: no URL for agent(s) {sorted(missing)}: give --agent-url NAME=URL "
            "(finding them through the head server needs PyYAML)"
        ) from e

    from rolloutlog.integrations.nemo_gym._config import server_dict

    # the head server answers a JSON string holding the config's YAML
    text = orjson.loads(httpx.get(args.head_server + "/global_config_dict_yaml").content)
    config: dict[str, Any] = yaml.safe_load(text)
    for name in missing:
        inner = server_dict(config, name)
        urls[name] = f"http://{inner['host']}:{inner['port']}"
    return urls


def _collect(args: argparse.Namespace) -> int:
    from rolloutlog.integrations.nemo_gym._collector import AGENT_REF, materialize_rows

    run = args.run or os.environ.get("ROLLOUTLOG_RUN")
    if not run:
        print("collect: give --run (or ROLLOUTLOG_RUN)", file=sys.stderr)
        return 2
    lines = Path(args.input).read_bytes().splitlines()
    rows = materialize_rows(lines, agent=args.agent, limit=args.limit, num_repeats=args.num_repeats)
    output = Path(args.output)
    materialized = output.with_name(output.stem + "_materialized_inputs.jsonl")
    output.parent.mkdir(parents=True, exist_ok=True)
    materialized.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    agents = _agent_urls(args, {row[AGENT_REF]["name"] for row in rows})
    return asyncio.run(_collect_rows(args, run, rows, agents))


async def _collect_rows(
    args: argparse.Namespace, run: str, rows: list[dict[str, Any]], agents: dict[str, str]
) -> int:
    from rolloutlog.integrations.nemo_gym._collector import GymCollector, summary
    from rolloutlog.participants import HttpTransport, KafkaTransport, Restores, Transport
    from rolloutlog.trainer import AsyncTrainerClient

    transport: Transport
    if args.kafka:
        transport = KafkaTransport(args.kafka, url=args.url, token=args.token)
    else:
        transport = HttpTransport(args.url, token=args.token)
    async with (
        transport,
        AsyncTrainerClient(args.url, token=args.token) as trainer,
        Restores(args.url, token=args.token) as restores,
    ):
        collector = GymCollector(
            run=run,
            agents=agents,
            output=Path(args.output),
            transport=transport,
            trainer=trainer,
            restores=restores,
            participant_id=args.participant_id,
            concurrency=args.concurrency,
            checkpoint_every_s=args.checkpoint_every_s,
            deadline_s=args.deadline_s,
            partitions=args.partitions,
            fork_from=args.fork_from,
            fork_checkpoint=_checkpoint(args.fork_checkpoint),
            policy_version=args.policy_version,
        )
        try:
            report = await collector.run(rows)
        finally:
            await collector.close()
    print(summary(report), flush=True)
    if report.interrupted:
        print(
            f"{len(report.interrupted)} rollout(s) interrupted (the Gym failed: "
            f"{report.interrupted[0]}); start the Gym again and run the same command: "
            "it resumes from the latest checkpoint",
            file=sys.stderr,
        )
        return 3
    if report.stopped:
        print("stopped on SIGTERM after its checkpoint; run the same command to resume")
    return 0


def _checkpoint(value: str) -> int | str:
    return value if value == "latest" else int(value)


def _venv(args: argparse.Namespace) -> int:
    from rolloutlog.integrations.nemo_gym._venv import ensure_venv, find_python

    python = args.python or find_python()
    if python is None:
        print("no Python >= 3.12 found (pyenv, PATH, ROLLOUTLOG_NEMO_GYM_PYTHON)", file=sys.stderr)
        return 2
    print(ensure_venv(python) / "bin" / "python")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m rolloutlog.integrations.nemo_gym", description=__doc__
    )
    commands = top.add_subparsers(dest="command", required=True)

    launch = commands.add_parser(
        "launch", help="start a NeMo Gym config's servers without Ray, rolloutlog attached"
    )
    launch.add_argument("config", nargs="+", help="NeMo Gym config YAML files (config_paths)")
    launch.add_argument("--override", action="append", default=[], help="key=value (hydra-style)")
    launch.add_argument("--only", action="append", help="start only this server (repeatable)")
    launch.add_argument("--log-dir", help="one log file per server here (else inherit stdout)")
    launch.add_argument("--state", help="write pids and URLs here (JSON) once all are ready")
    launch.add_argument("--resolved", help="write the resolved config here (ports included)")
    launch.add_argument("--no-head", action="store_true", help="no NeMo Gym head server")
    launch.set_defaults(func=_launch)

    overlay = commands.add_parser(
        "overlay", help="write the server shims that make stock ng_run attach rolloutlog"
    )
    overlay.add_argument("config", nargs="+", help="NeMo Gym config YAML files (config_paths)")
    overlay.add_argument("--override", action="append", default=[], help="key=value")
    overlay.add_argument("--dir", required=True, help="the directory to run ng_run from")
    overlay.set_defaults(func=_overlay)

    serve = commands.add_parser("serve", help="run one server (config from NEMO_GYM_CONFIG_DICT)")
    serve.add_argument("name", nargs="?", help="server instance (else NEMO_GYM_CONFIG_PATH)")
    serve.set_defaults(func=_serve)

    collect = commands.add_parser(
        "collect", help="collect rollouts from a dataset JSONL with checkpoints; resumable"
    )
    collect.add_argument("--input", required=True, help="NeMo Gym dataset JSONL")
    collect.add_argument("--output", required=True, help="rollout JSONL (appended; resumed)")
    collect.add_argument("--agent", help="agent server for rows without agent_ref")
    collect.add_argument("--agent-url", action="append", default=[], help="NAME=URL")
    collect.add_argument("--head-server", default="http://127.0.0.1:11000")
    collect.add_argument("--run", help="rolloutlog run (else ROLLOUTLOG_RUN)")
    collect.add_argument("--url", default=None, help="rolloutlog service (else ROLLOUTLOG_URL)")
    collect.add_argument("--token", default=None, help="else ROLLOUTLOG_TOKEN")
    collect.add_argument("--kafka", default=None, help="append events straight to this Kafka")
    collect.add_argument("--participant-id", default="collector")
    collect.add_argument("--concurrency", type=int, default=16)
    collect.add_argument("--limit", type=int)
    collect.add_argument("--num-repeats", type=int, default=1)
    collect.add_argument("--checkpoint-every-s", type=float)
    collect.add_argument("--deadline-s", type=float, help="a checkpoint's deadline")
    collect.add_argument("--partitions", type=int)
    collect.add_argument("--fork-from", help="the run is a fork of this run (created if new)")
    collect.add_argument(
        "--fork-checkpoint", default="latest", help="the source's checkpoint id (or latest)"
    )
    collect.add_argument("--policy-version", type=int, help="the trainer's, for the restore")
    collect.set_defaults(func=_collect)

    venv = commands.add_parser("venv", help="build (once) the Python >= 3.12 NeMo Gym venv")
    venv.add_argument("--python", help="the interpreter (else found: pyenv, PATH)")
    venv.set_defaults(func=_venv)
    return top


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
