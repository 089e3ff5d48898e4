"""Real NeMo Gym 0.4.0 server processes for the tests: the cached venv, the launcher, the fake
inference backend, datasets with scripted model turns, and SIGKILL by process group.

- ``gym_python()``: the one way tests find the NeMo Gym venv (``rolloutlog.integrations.
  nemo_gym._venv``); no Python >= 3.12, or a venv not built yet (``make nemo-gym-venv``): the
  test is ``unavailable`` (skipped locally, failed in CI, whose ``.ci/run`` builds it).
- ``Backend``: the fake OpenAI-compatible backend (``rolloutlog.integrations.nemo_gym.
  fake_backend``) in its own session: it logs every call and outlives the Gym's crashes.
- ``GymProcesses``: ``launch()`` runs ``python -m rolloutlog.integrations.nemo_gym launch`` in
  the venv (the checkout's code on ``PYTHONPATH``) and reads its state file; ``kill()`` SIGKILLs
  the launcher's group and every server's; ``launch()`` again starts them on the same ports.
- ``counter_row`` / ``steps_row``: dataset rows for ``example_session_state_mgmt`` and
  ``example_multi_step`` whose model turns are scripted (``metadata.fake_script``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from rolloutlog.integrations.nemo_gym._venv import find_python, gym_env, venv_path
from rolloutlog.participants.sim import die_with_parent
from tests._services import ROOT, free_port, unavailable
from tests.api.conftest import TOKENS

GYM_START_S = 300.0


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


def require_fake_backend() -> None:
    if importlib.util.find_spec("rolloutlog.integrations.nemo_gym.fake_backend") is None:
        unavailable("rolloutlog.integrations.nemo_gym.fake_backend is not in this checkout")


def _spawn(
    command: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            command,
            cwd=log.parent,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


async def wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} did not answer")


class Backend:
    """The fake inference backend (one per test module); its call log survives the Gym."""

    def __init__(self, workdir: Path) -> None:
        require_fake_backend()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.call_log = workdir / "calls.jsonl"
        command = [sys.executable, "-m", "rolloutlog.integrations.nemo_gym.fake_backend"]
        command += ["--port", str(self.port), "--call-log", str(self.call_log)]
        self.proc = _spawn(
            command, workdir / "backend.log", {**os.environ, "PYTHONPATH": str(ROOT)}
        )

    async def start(self) -> None:
        await wait_http(self.url + "/health")

    def stop(self) -> None:
        kill_group(self.proc.pid)
        self.proc.wait()

    async def hold(self, match: str, turn: int, after_tokens: int = 0) -> None:
        body = {"match": match, "turn": turn, "after_tokens": after_tokens}
        async with httpx.AsyncClient() as client:
            (await client.post(self.url + "/fake/holds", json=body)).raise_for_status()

    async def wait_parked(self, count: int, timeout_s: float = 120.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=60) as client:
            while True:
                parked: list[dict[str, Any]] = (
                    await client.get(self.url + "/fake/held", params={"wait_s": 5})
                ).json()["parked"]
                if len(parked) >= count:
                    return parked
                assert time.monotonic() < deadline, f"{len(parked)} of {count} calls parked"

    async def release(self) -> None:
        async with httpx.AsyncClient() as client:
            (await client.post(self.url + "/fake/release")).raise_for_status()

    def calls(self) -> list[dict[str, Any]]:
        from rolloutlog.integrations.nemo_gym.fake_backend import read_call_log

        calls: list[dict[str, Any]] = read_call_log(self.call_log)
        return calls

    def scores(self) -> list[dict[str, Any]]:
        """The scoring requests (prefills, nothing generated)."""
        from rolloutlog.integrations.nemo_gym.fake_backend import read_scores

        scores: list[dict[str, Any]] = read_scores(self.call_log)
        return scores


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


def _tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": name,
        "description": "",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": properties,
            "required": list(properties),
            "additionalProperties": False,
        },
    }


def _params(prompt: str, tools: list[dict[str, Any]], script: list[Any]) -> dict[str, Any]:
    return {
        "input": [{"role": "user", "content": prompt}],
        "tools": tools,
        "metadata": {"fake_script": json.dumps(script)},
    }


def counter_row(index: int, *, right: bool = True) -> dict[str, Any]:
    """Add two numbers to a counter seeded at ``index`` and read it; the reward is 1.0 when the
    counter ends at the expected count (``right=False``: the script adds one too few)."""
    a, b = index + 1, index + 2
    script = [
        {
            "calls": [
                {"call": "increment_counter", "arguments": {"count": a}},
                {"call": "increment_counter", "arguments": {"count": b if right else b - 1}},
            ]
        },
        {"call": "get_counter_value", "arguments": {}},
        {"say": f"the count is {index + a + b}"},
    ]
    tools = [
        _tool("increment_counter", {"count": {"type": "integer", "description": ""}}),
        _tool("get_counter_value", {}),
    ]
    prompt = f"counter task {index}: add {a} then add {b} then get the count"
    return {
        "responses_create_params": _params(prompt, tools, script),
        "expected_count": index + a + b,
        "initial_count": index,
        "agent_ref": {"name": "counter_agent"},
    }


def steps_row(index: int, *, right: bool = True) -> dict[str, Any]:
    """Look up two synonyms' values, then extract them; the reward is 1.0 when the extracted
    values are the expected ones (``right=False``: the script swaps them)."""
    synonyms = [f"Word{index}a", f"Word{index}b"]
    values = [sum(map(ord, s)) for s in synonyms]
    extracted = values if right else values[::-1]
    script = [
        {"calls": [{"call": "get_synonym_value", "arguments": {"synonym": s}} for s in synonyms]},
        {"call": "extract_synonym_values", "arguments": {"synonym_values": extracted}},
        {"say": "done"},
    ]
    tools = [
        _tool("get_synonym_value", {"synonym": {"type": "string", "description": ""}}),
        _tool(
            "extract_synonym_values",
            {"synonym_values": {"type": "array", "items": {"type": "integer"}, "description": ""}},
        ),
    ]
    prompt = f"steps task {index}: get the values of {synonyms[0]} and {synonyms[1]}"
    return {
        "id": index,
        "responses_create_params": _params(prompt, tools, script),
        "expected_synonym_values": values,
        "expected_synonyms": synonyms,
        "minefield_label": "Mine",
        "minefield_label_value": 0,
        "agent_ref": {"name": "steps_agent"},
    }


class GymProcesses:
    """A NeMo Gym config's servers started by the launcher in the venv (module docstring)."""

    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        self.python = gym_python()
        self.workdir = workdir
        self.config_path = workdir / "gym.yaml"
        self.config_path.write_text(json.dumps(config))  # YAML is a superset of JSON
        self.resolved = workdir / "gym-resolved.yaml"
        self.state_path = workdir / "gym-state.json"
        self.logs = workdir / "gym-logs"
        self.launcher: subprocess.Popen[bytes] | None = None
        self.state: dict[str, Any] = {}
        self.launches = 0

    async def launch(self) -> dict[str, Any]:
        """Start every server (from the resolved config after the first launch: same ports)."""
        self.state_path.unlink(missing_ok=True)
        config = self.resolved if self.resolved.exists() else self.config_path
        command = [str(self.python), "-m", "rolloutlog.integrations.nemo_gym", "launch"]
        command += [str(config), "--log-dir", str(self.logs), "--state", str(self.state_path)]
        command += ["--resolved", str(self.resolved)]
        self.launches += 1
        self.launcher = _spawn(
            command, self.workdir / "launcher.log", gym_env(self.python.parents[1], ROOT)
        )
        deadline = time.monotonic() + GYM_START_S
        while not self.state_path.exists():
            if self.launcher.poll() is not None:
                raise AssertionError(f"the launcher exited: {self.tail()}")
            assert time.monotonic() < deadline, f"the Gym did not start: {self.tail()}"
            await asyncio.sleep(0.2)
        self.state = orjson.loads(self.state_path.read_bytes())
        return self.state

    def url(self, name: str) -> str:
        url: str = self.state["servers"][name]["url"]
        return url

    def groups(self) -> list[int]:
        """Every NeMo Gym process group: the launcher's (head server) and each server's."""
        pids = [s["pid"] for s in self.state.get("servers", {}).values()]
        return [self.launcher.pid, *pids] if self.launcher is not None else pids

    def kill(self) -> None:
        """SIGKILL every NeMo Gym process group."""
        for pid in self.groups():
            kill_group(pid)
        if self.launcher is not None:
            self.launcher.wait()

    def stop(self) -> None:
        if self.launcher is not None and self.launcher.poll() is None:
            self.launcher.send_signal(signal.SIGTERM)
            try:
                self.launcher.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        for pid in self.groups():
            kill_group(pid)

    def tail(self, chars: int = 3000) -> str:
        logs = sorted(self.logs.glob("*.log")) if self.logs.exists() else []
        text = "".join(f"== {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in logs)
        launcher = self.workdir / "launcher.log"
        if launcher.exists():
            text += f"== launcher\n{launcher.read_text(errors='replace')[-chars:]}"
        return text


def start_collector(
    dataset: Path,
    output: Path,
    log: Path,
    *,
    service_url: str,
    run: str,
    agents: dict[str, str],
    kafka: str | None = None,
) -> subprocess.Popen[bytes]:
    """``python -m rolloutlog.integrations.nemo_gym collect`` in its own session (the test's
    venv, the checkout's code), over ``dataset`` into ``output``; ``agents``: name -> URL."""
    command = [sys.executable, "-m", "rolloutlog.integrations.nemo_gym", "collect"]
    command += ["--input", str(dataset), "--output", str(output), "--run", run]
    command += ["--url", service_url, "--token", TOKENS["admin"], "--concurrency", "8"]
    if kafka is not None:
        command += ["--kafka", kafka]
    for name, url in agents.items():
        command += ["--agent-url", f"{name}={url}"]
    return _spawn(command, log, {**os.environ, "PYTHONPATH": str(ROOT)})


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
