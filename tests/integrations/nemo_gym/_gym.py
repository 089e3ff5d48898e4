"""Real NeMo Gym 0.4.0 server processes for the tests, on the package's own harness
(``rolloutlog.integrations.nemo_gym._processes``: the fake backend, the launcher in the venv,
SIGKILL by process group; ``_rows``: dataset rows with scripted model turns).

- ``gym_python()``: the one way tests find the NeMo Gym venv (``rolloutlog.integrations.
  nemo_gym._venv``); no Python >= 3.12, or a venv not built yet (``make nemo-gym-venv``): the
  test is ``unavailable`` (skipped locally, failed in CI, whose ``.ci/run`` builds it).
- ``Backend``: the fake backend in the test's directory; ``GymProcesses(workdir, config)``: the
  config's servers from the venv ``gym_python()`` finds.
- ``gym_config``: the counter (restart-only) and ``example_multi_step`` (stateless) behind
  stock SimpleAgents on one vllm_model; ``start_collector``/``finish_collector``: the collector
  command; ``chunk_durable``: wait for a generation chunk in the log.
"""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rolloutlog.integrations.nemo_gym._processes import (
    FakeBackendProcess,
    kill_group,
    spawn,
    wait_http,
)
from rolloutlog.integrations.nemo_gym._processes import GymProcesses as _GymProcesses
from rolloutlog.integrations.nemo_gym._rows import counter_row, steps_row
from rolloutlog.integrations.nemo_gym._venv import find_python, venv_path
from tests._services import ROOT, free_port, unavailable
from tests.api.conftest import TOKENS

__all__ = [
    "Backend",
    "GymProcesses",
    "chunk_durable",
    "counter_row",
    "finish_collector",
    "gym_config",
    "gym_python",
    "kill_group",
    "start_collector",
    "steps_row",
    "wait_http",
]


@functools.cache
def _venv() -> Path | str:
    python = find_python()
    if python is None:
        return "no Python >= 3.12 for NeMo Gym 0.4.0 (pyenv, PATH, ROLLOUTLOG_NEMO_GYM_PYTHON)"
    venv = venv_path(python)
    if not (venv / ".complete").exists():
        return f"the NeMo Gym venv {venv} is not built: `make nemo-gym-venv`"
    return venv


def gym_python() -> Path:
    """The NeMo Gym venv's interpreter (the test is unavailable without one)."""
    venv = _venv()
    if isinstance(venv, str):
        unavailable(venv)
        raise AssertionError("unreachable")
    return venv / "bin" / "python"


class Backend(FakeBackendProcess):
    """The fake backend, logging into the test's directory."""


def gym_config(service_url: str, run: str, backend: Backend) -> dict[str, Any]:
    """Two environments on one policy: the stateful counter (restart-only: its state lives in
    the process) and the multi-step extraction (stateless), each behind a stock SimpleAgent."""

    def agent(resources: str) -> dict[str, Any]:
        return {
            "responses_api_agents": {
                "simple_agent": {
                    "entrypoint": "app.py",
                    "port": free_port(),
                    "resources_server": {"type": "resources_servers", "name": resources},
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                }
            }
        }

    return {
        "head_server": {"host": "127.0.0.1", "port": free_port()},
        "rolloutlog": {"url": service_url, "run": run, "token": TOKENS["participant"]},
        "counter": {
            "resources_servers": {
                "example_session_state_mgmt": {
                    "entrypoint": "app.py",
                    "domain": "agent",
                    "port": free_port(),
                    "rolloutlog": {"mode": "restart_only"},
                }
            }
        },
        "counter_agent": agent("counter"),
        "steps": {
            "resources_servers": {
                "example_multi_step": {
                    "entrypoint": "app.py",
                    "domain": "instruction_following",
                    "port": free_port(),
                    "rolloutlog": {"mode": "stateless", "verify": "replay"},
                }
            }
        },
        "steps_agent": agent("steps"),
        "policy_model": {
            "responses_api_models": {
                "vllm_model": {
                    "entrypoint": "app.py",
                    "port": free_port(),
                    "base_url": backend.url + "/v1",
                    "api_key": "fake",
                    "model": "fake",
                    "return_token_id_information": True,
                    "uses_reasoning_parser": False,
                }
            }
        },
    }


class GymProcesses(_GymProcesses):
    """The config's servers from the venv ``gym_python()`` finds."""

    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        super().__init__(gym_python(), workdir, config)


def start_collector(
    dataset: Path,
    output: Path,
    log: Path,
    *,
    service_url: str,
    run: str,
    agents: dict[str, str],
    kafka: str | None = None,
    options: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    """``python -m rolloutlog.integrations.nemo_gym collect`` in its own session (the test's
    venv, the checkout's code), over ``dataset`` into ``output``; ``agents``: name -> URL;
    ``options``: more of its flags."""
    command = [sys.executable, "-m", "rolloutlog.integrations.nemo_gym", "collect"]
    command += ["--input", str(dataset), "--output", str(output), "--run", run]
    command += ["--url", service_url, "--token", TOKENS["admin"], "--concurrency", "8"]
    if kafka is not None:
        command += ["--kafka", kafka]
    for name, url in agents.items():
        command += ["--agent-url", f"{name}={url}"]
    command += options
    return spawn(command, log, {**os.environ, "PYTHONPATH": str(ROOT)})


async def finish_collector(proc: subprocess.Popen[bytes], log: Path, gym: GymProcesses) -> str:
    """Wait for a collector to exit 0; its log."""
    code = await asyncio.to_thread(proc.wait, 600)
    text = await asyncio.to_thread(log.read_text, errors="replace")
    assert code == 0, f"collector exit {code}: {text[-3000:]}\n{gym.tail()}"
    return text


async def chunk_durable(trainer: Any, run: str, episode: str, start: int) -> None:
    """Wait until the episode's generation chunk starting at ``start`` is in the log
    (``trainer``: an ``AsyncTrainerClient``)."""
    for _ in range(600):
        history = await trainer.episode_history(run, episode)
        events = history.get("events") or history.get("timeline") or []
        starts = {
            (e.get("data") or {}).get("start") for e in events if e["type"] == "generation.chunk"
        }
        if start in starts:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no chunk of {episode} starting at {start}")
