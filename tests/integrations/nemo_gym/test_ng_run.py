"""Stock ``ng_run`` (its head server, its Ray cluster, a shell per server) serving the shims of
``python -m rolloutlog.integrations.nemo_gym overlay``: the same NeMo Gym servers, rolloutlog
attached, without the launcher."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from rolloutlog.integrations.nemo_gym._venv import gym_env
from rolloutlog.participants.sim import die_with_parent
from rolloutlog.trainer import AsyncTrainerClient
from tests._services import ROOT
from tests.api.conftest import TOKENS
from tests.e2e._harness import Deployment, Service
from tests.integrations.nemo_gym._gym import (
    Backend,
    counter_row,
    gym_config,
    gym_python,
    kill_group,
    wait_http,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def write_overlay(python: Path, env: dict[str, str], config: Path, overlay: Path) -> None:
    command = [str(python), "-m", "rolloutlog.integrations.nemo_gym", "overlay", str(config)]
    subprocess.run([*command, "--dir", str(overlay)], env=env, check=True, capture_output=True)


def start_ng_run(
    python: Path, env: dict[str, str], config: Path, overlay: Path, log: Path
) -> subprocess.Popen[bytes]:
    command = [str(python.parent / "ng_run"), f"+config_paths=[{config}]"]
    command += ["+skip_venv_if_present=true", f"+uv_venv_dir={overlay}"]
    with open(log, "ab") as out:
        return subprocess.Popen(
            command,
            cwd=overlay,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def collect(command: list[str]) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, env=env, capture_output=True, timeout=300, check=False)


async def test_stock_ng_run_serves_the_servers_with_rolloutlog_attached(tmp_path: Path) -> None:
    python = gym_python()
    env = gym_env(python.parents[1], ROOT)
    service = Service(Deployment("embedded", tmp_path / "data"), tmp_path)
    await service.start()
    backend = Backend(tmp_path)
    ng_run: subprocess.Popen[bytes] | None = None
    try:
        await backend.start()
        config = gym_config(service.url, "ngrun", backend)
        for name in ("steps", "steps_agent"):
            del config[name]
        config_path = tmp_path / "gym.yaml"
        config_path.write_text(json.dumps(config))
        overlay = tmp_path / "overlay"
        await asyncio.to_thread(write_overlay, python, env, config_path, overlay)
        ng_run = start_ng_run(python, env, config_path, overlay, tmp_path / "ng_run.log")
        urls = {
            name: f"http://127.0.0.1:{next(iter(next(iter(config[name].values())).values()))['port']}"
            for name in ("counter", "counter_agent", "policy_model")
        }
        for url in urls.values():
            await wait_http(url + "/", timeout_s=600)
        dataset = tmp_path / "dataset.jsonl"
        dataset.write_bytes(b"".join(orjson.dumps(counter_row(i)) + b"\n" for i in range(2)))
        output = tmp_path / "rollouts.jsonl"
        command = [sys.executable, "-m", "rolloutlog.integrations.nemo_gym", "collect"]
        command += ["--input", str(dataset), "--output", str(output), "--run", "ngrun"]
        command += ["--url", service.url, "--token", TOKENS["admin"]]
        command += ["--agent-url", f"counter_agent={urls['counter_agent']}"]
        done = await asyncio.to_thread(collect, command)
        assert done.returncode == 0, done.stdout + done.stderr
        rows = [orjson.loads(line) for line in output.read_bytes().splitlines()]
        assert sorted(row["reward"] for row in rows) == [1.0, 1.0]
        async with AsyncTrainerClient(service.url, token=TOKENS["admin"]) as trainer:
            history = await trainer.episode_history("ngrun", "t1-r0")
        started = [e for e in history["events"] if e["type"] == "session.started"]
        assert [(e["participant"], e["kind"]) for e in started] == [("counter", "resources")]
    finally:
        if ng_run is not None:
            ng_run.send_signal(signal.SIGINT)  # ng_run stops its servers and its Ray cluster
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(ng_run.wait, 60)
            # Its servers' shells outlive it in its process group: they go with the group.
            kill_group(ng_run.pid)
            ng_run.wait()
        backend.stop()
        service.stop()
