"""Real NeMo Gym processes for the demo, the benchmark and the tests: the fake inference backend
and a config's servers started by the launcher in the NeMo Gym venv, each killable by group.

- ``FakeBackendProcess``: ``python -m rolloutlog.integrations.nemo_gym.fake_backend`` in its own session
  (this interpreter, the checkout's code): it logs every call and outlives the Gym's crashes.
- ``GymProcesses``: ``launch()`` runs ``python -m rolloutlog.integrations.nemo_gym launch`` in
  the venv (the checkout's code on ``PYTHONPATH``, ``gym_env``) and reads its state file;
  ``kill()`` SIGKILLs the launcher's group (the head server) and every server's; ``launch()``
  again starts them on the same ports (from the resolved config).
"""

from __future__ import annotations

import asyncio
import contextlib
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

from rolloutlog.integrations.nemo_gym._venv import ROOT, gym_env
from rolloutlog.participants.sim import die_with_parent, free_port

__all__ = ["FakeBackendProcess", "GymProcesses", "kill_group", "spawn", "wait_http"]

GYM_START_S = 300.0


def spawn(
    command: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``command`` in its own session (a process group to SIGKILL), its output to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
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
    """Until ``GET url`` answers 200."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} did not answer")


class FakeBackendProcess:
    """The fake inference backend; its call log survives the Gym (module docstring)."""

    def __init__(self, workdir: Path, *, token_rate: float | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.call_log = workdir / "calls.jsonl"
        command = [sys.executable, "-m", "rolloutlog.integrations.nemo_gym.fake_backend"]
        command += ["--port", str(self.port), "--call-log", str(self.call_log)]
        if token_rate is not None:
            command += ["--token-rate", str(token_rate)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = spawn(command, workdir / "backend.log", env)

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
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(parked)} of {count} calls parked")

    async def release(self) -> None:
        async with httpx.AsyncClient() as client:
            (await client.post(self.url + "/fake/release")).raise_for_status()

    def calls(self) -> list[dict[str, Any]]:
        """Every model call so far (``read_call_log``)."""
        from rolloutlog.integrations.nemo_gym.fake_backend import read_call_log

        calls: list[dict[str, Any]] = read_call_log(self.call_log)
        return calls

    def scores(self) -> list[dict[str, Any]]:
        """The scoring requests (prefills, nothing generated)."""
        from rolloutlog.integrations.nemo_gym.fake_backend import read_scores

        scores: list[dict[str, Any]] = read_scores(self.call_log)
        return scores


class GymProcesses:
    """A NeMo Gym config's servers started by the launcher in the venv (module docstring).
    ``python``: the venv's interpreter."""

    def __init__(self, python: Path, workdir: Path, config: dict[str, Any]) -> None:
        self.python = python
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "gym.yaml"
        self.config_path.write_text(json.dumps(config))  # YAML is a superset of JSON
        self.resolved = workdir / "gym-resolved.yaml"
        self.state_path = workdir / "gym-state.json"
        self.logs = workdir / "gym-logs"
        self.launcher: subprocess.Popen[bytes] | None = None
        self.state: dict[str, Any] = {}
        self.launches = 0

    async def launch(self, timeout_s: float = GYM_START_S) -> dict[str, Any]:
        """Start every server (from the resolved config after the first launch: same ports)."""
        self.state_path.unlink(missing_ok=True)
        config = self.resolved if self.resolved.exists() else self.config_path
        command = [str(self.python), "-m", "rolloutlog.integrations.nemo_gym", "launch"]
        command += [str(config), "--log-dir", str(self.logs), "--state", str(self.state_path)]
        command += ["--resolved", str(self.resolved)]
        self.launches += 1
        env = gym_env(self.python.parents[1], ROOT)
        self.launcher = spawn(command, self.workdir / "launcher.log", env)
        deadline = time.monotonic() + timeout_s
        while not self.state_path.exists():
            if self.launcher.poll() is not None:
                raise RuntimeError(f"the launcher exited: {self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Gym did not start: {self.tail()}")
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
