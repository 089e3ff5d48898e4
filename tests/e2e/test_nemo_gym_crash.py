"""Real NeMo Gym 0.4.0 servers crashed and restored through rolloutlog, on both deployments.

The Gym (from the cached venv, started by the launcher without Ray, one process group per
server; the harness is ``tests/integrations/nemo_gym/_gym.py``): NeMo Gym's stateful counter
(``example_session_state_mgmt``) declared ``exported`` with the worked example's
``CounterState``; the same counter served restart-less without it (``stateless``: the negative
control); ``example_multi_step`` (stateless); a ``RolloutlogSimpleAgent`` for each and one
``RolloutlogVLLMModel`` streaming from the fake backend, which outlives the crash and logs every
call. The collector (``python -m rolloutlog.integrations.nemo_gym collect``) is the trainer.

An uninterrupted reference run of the rows first; then the same rows with four in flight: two
counters and the control parked at the resources server mid-tool-round (after the model call
that asked for the tools was delivered), one multi-step parked at the backend mid-generation,
while the other two finish. A checkpoint on SIGUSR1, SIGKILL of the collector and of every NeMo
Gym process group, the Gym launched again, the same collector command. Asserted: every row
written once with the reference's reward, but the control's 0.0 (its count is gone: without
rolloutlog, after a SIGKILL the old session is accepted but the count is 0); the backend's
exact call log (no model call made twice: the delivered calls come back as terminal cuts,
served from their tokens with one prefill for their log probabilities, the cut mid-generation
is continued); each replacement call's parent resolves among the restored rows.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rolloutlog.integrations.nemo_gym import episode_id
from rolloutlog.trainer import AsyncTrainerClient
from tests._services import free_port
from tests.api.conftest import TOKENS
from tests.e2e._harness import Deployment, Service
from tests.integrations.nemo_gym._gym import (
    Backend,
    GymProcesses,
    chunk_durable,
    counter_row,
    finish_collector,
    gym_config,
    gym_python,
    kill_group,
    start_collector,
    steps_row,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RUN = "gym-restore"
AGENT = "rolloutlog.integrations.nemo_gym:RolloutlogSimpleAgent"
POLICY = "rolloutlog.integrations.nemo_gym:RolloutlogVLLMModel"
HELD = "tests.integrations.nemo_gym._held:HeldCounter"
COUNTER_STATE = "rolloutlog.integrations.nemo_gym.examples.session_counter:CounterState"
#: the crash run's task indices (the reference run's are 0-5)
CRASH = 100


def rows() -> dict[str, dict[str, Any]]:
    """The rows by name; each name's task index is its position (``_ng_task_index``)."""
    control = counter_row(2)
    control["agent_ref"] = {"name": "plain_agent"}
    steps = steps_row(4)
    steps["responses_create_params"]["metadata"]["fake_tokens"] = "80"  # a long turn to cut
    return {
        "counter-tool": counter_row(0),  # parked at get_counter_value (turn 1's tool round)
        "counter-round": counter_row(1),  # parked at its second increment (turn 0's round)
        "control": control,  # the counter without its state restored: parked as counter-tool
        "counter-done": counter_row(3),  # finishes before the checkpoint
        "steps-cut": steps,  # parked 48 streamed tokens into turn 1 (filler): a cut continued
        "steps-done": steps_row(5),  # finishes before the checkpoint
    }


ROWS = rows()
INDEX = {name: i for i, name in enumerate(ROWS)}
#: resources tool calls parked in the crash run: (route, its n-th request in the attempt)
TOOL_HOLDS = {
    "counter-tool": ("get_counter_value", 1),
    "counter-round": ("increment_counter", 2),
    "control": ("get_counter_value", 1),
}
IN_FLIGHT = [*TOOL_HOLDS, "steps-cut"]


def key(name: str) -> str:
    return f"t{CRASH + INDEX[name]}-r0"


def prompt(name: str) -> str:
    """What the backend's call log knows a row by (its first user message)."""
    text: str = ROWS[name]["responses_create_params"]["input"][0]["content"]
    return text


def config(service: Service, backend: Backend, holds_dir: Path) -> dict[str, Any]:
    base = gym_config(service.url, RUN, backend)
    counter = base["counter"]["resources_servers"]["example_session_state_mgmt"]
    counter["rolloutlog"] = {"mode": "exported", "state": COUNTER_STATE, "server_class": HELD}
    plain = {**counter, "port": free_port(), "rolloutlog": {"mode": "stateless"}}
    plain["rolloutlog"]["server_class"] = HELD
    plain_agent = json.loads(json.dumps(base["counter_agent"]))
    inner = plain_agent["responses_api_agents"]["simple_agent"]
    inner.update(port=free_port(), resources_server={"type": "resources_servers", "name": "plain"})
    base["plain"] = {"resources_servers": {"example_session_state_mgmt": plain}}
    base["plain_agent"] = plain_agent
    for agent in ("counter_agent", "plain_agent", "steps_agent"):
        base[agent]["responses_api_agents"]["simple_agent"]["rolloutlog"] = {"server_class": AGENT}
    base["policy_model"]["responses_api_models"]["vllm_model"]["rolloutlog"] = {
        "server_class": POLICY,
        "stream": True,
        "chunk_tokens": 16,
        "tool_parser": "hermes",
    }
    if service.deployment.distributed:  # every participant appends straight to Kafka
        base["rolloutlog"]["kafka"] = service.deployment.log_url
    calls = {key(name): list(hold) for name, hold in TOOL_HOLDS.items()}
    base["tool_holds"] = json.dumps({"dir": str(holds_dir), "calls": calls})
    return base


class Collection:
    """The collector command over the rows, from a task index on."""

    def __init__(self, service: Service, gym: GymProcesses, workdir: Path, start: int) -> None:
        self.service = service
        self.gym = gym
        self.workdir = workdir
        self.output = workdir / f"rollouts-{start}.jsonl"
        self.log_path = workdir / f"collector-{start}.log"
        self.dataset = workdir / f"dataset-{start}.jsonl"
        self.dataset.write_bytes(
            b"".join(
                orjson.dumps({**row, "_ng_task_index": start + i}) + b"\n"
                for i, row in enumerate(ROWS.values())
            )
        )

    def start(self) -> subprocess.Popen[bytes]:
        agents = ("counter_agent", "plain_agent", "steps_agent")
        deployment = self.service.deployment
        return start_collector(
            self.dataset,
            self.output,
            self.log_path,
            service_url=self.service.url,
            run=RUN,
            agents={name: self.gym.url(name) for name in agents},
            kafka=deployment.log_url if deployment.distributed else None,
        )

    async def finish(self, proc: subprocess.Popen[bytes]) -> str:
        return await finish_collector(proc, self.log_path, self.gym)

    def rewards(self) -> dict[str, float]:
        """Row name -> reward; each row written exactly once."""
        written = [orjson.loads(line) for line in self.output.read_bytes().splitlines()]
        counts = Counter(episode_id(row) for row in written)
        assert set(counts.values()) == {1}, f"rows written twice: {counts}"
        names = list(ROWS)
        return {names[row["_ng_task_index"] % CRASH]: float(row["reward"]) for row in written}

    def written(self) -> int:
        return len(self.output.read_bytes().splitlines()) if self.output.exists() else 0


async def committed(service: Service) -> int:
    """The newest committed checkpoint's id."""
    async with AsyncTrainerClient(service.url, token=TOKENS["admin"]) as trainer:
        checkpoints = await trainer.list_checkpoints(RUN)
    return max((c.checkpoint_id for c in checkpoints if c.status == "committed"), default=0)


async def wait_for(what: str, ready: Any, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


@pytest.fixture
def venv() -> Path:
    """The NeMo Gym venv (asked for first: without one, no service is started)."""
    return gym_python()


@pytest.fixture
async def gym(
    venv: Path, service: Service, tmp_path: Path
) -> AsyncIterator[tuple[Backend, GymProcesses]]:
    backend = Backend(tmp_path)
    processes: GymProcesses | None = None
    try:
        await backend.start()
        async with AsyncTrainerClient(service.url, token=TOKENS["admin"]) as trainer:
            await trainer.create_run(RUN, partitions=4)
        (tmp_path / "holds").mkdir()
        processes = GymProcesses(tmp_path, config(service, backend, tmp_path / "holds"))
        await processes.launch()
        yield backend, processes
    finally:
        if processes is not None:
            processes.stop()
        backend.stop()


async def test_nemo_gym_rollouts_in_flight_survive_sigkill_of_every_process_group(
    venv: Path,
    deployment: Deployment,
    service: Service,
    gym: tuple[Backend, GymProcesses],
    tmp_path: Path,
) -> None:
    backend, processes = gym
    reference = Collection(service, processes, tmp_path, 0)
    await reference.finish(reference.start())
    expected = reference.rewards()
    assert expected == dict.fromkeys(ROWS, 1.0)
    before = len(backend.calls())
    turns = {
        name: [c["generated"] for c in backend.calls() if c["prompt"] == prompt(name)]
        for name in ROWS
    }

    # The crash run: four rows parked mid-rollout, two finished, a checkpoint, SIGKILL.
    await backend.hold(prompt("steps-cut"), turn=1, after_tokens=48)
    crash = Collection(service, processes, tmp_path, CRASH)
    collector = crash.start()
    await backend.wait_parked(1, timeout_s=300)
    holds = tmp_path / "holds"
    await wait_for(
        "tool calls parked", lambda: len(list(holds.glob("parked-*"))) == len(TOOL_HOLDS)
    )
    await wait_for("the other rows written", lambda: crash.written() == len(ROWS) - len(IN_FLIGHT))
    async with AsyncTrainerClient(service.url, token=TOKENS["admin"]) as trainer:
        # 48 tokens durable: chunks at 0, 16, 32
        await chunk_durable(trainer, RUN, key("steps-cut"), 32)
    checkpoint = await committed(service)
    collector.send_signal(signal.SIGUSR1)  # checkpoint, and go on
    await wait_for_checkpoint(service, checkpoint)
    kill_group(collector.pid)
    processes.kill()
    collector.wait()
    # The parked call's client is gone: give the backend time to see its socket close (the
    # call then ends where it was parked) before it is released, or it may stream on into the
    # dead socket and log more tokens than the client ever read.
    held = prompt("steps-cut")
    for _ in range(100):  # 10 s at most
        calls = backend.calls()[before:]
        if any(c["prompt"] == held and c["turn"] == 1 and "generated" in c for c in calls):
            break
        await asyncio.sleep(0.1)
    await backend.release()  # the parked call answers a dead socket
    crashed = len(backend.calls())
    await processes.launch()
    log = await crash.finish(crash.start())

    # Every row once; every reward the reference's, but the control's: its count is gone.
    assert crash.rewards() == {**expected, "control": 0.0}
    assert f"already done {len(ROWS) - len(IN_FLIGHT)}" in log and "continued 4" in log, log

    # The backend's exact call log of the crash run: (turn, tokens continued, generated).
    calls = backend.calls()[before:]
    by_row = {
        name: [
            (c["turn"], c["continued"], c.get("generated"))
            for c in calls
            if c["prompt"] == prompt(name)
        ]
        for name in ROWS
    }
    full = {name: [(turn, 0, n) for turn, n in enumerate(turns[name])] for name in ROWS}
    first_cut = turns["steps-cut"][1]
    assert by_row == {
        **full,
        "steps-cut": [
            full["steps-cut"][0],
            (1, 0, 48),  # parked, then its stream was cut off by the kill
            (1, 48, first_cut - 48),  # continued from the cut: no token generated twice
            full["steps-cut"][2],
        ],
    }, by_row
    # nothing of the finished rows ran again; the delivered calls came back as terminal cuts,
    # each served with one prefill of its tokens (its log probabilities), no token generated
    after = backend.calls()[crashed:]
    assert not [c for c in after if c["prompt"] in (prompt("counter-done"), prompt("steps-done"))]
    scores = sorted((s["prompt"], s["turn"]) for s in backend.scores())
    assert scores == sorted(
        [(prompt("counter-tool"), 1), (prompt("control"), 1), (prompt("counter-round"), 0)]
    )

    # Lineage: each replacement call's parent resolves (restored rows first).
    async with httpx.AsyncClient(timeout=30) as client:
        stats = (await client.get(f"{processes.url('policy_model')}/rolloutlog/stats")).json()
    parents = {c["call_id"]: c["parent_call_id"] for c in stats["calls"]}
    tool, control, round_, cut = (
        key(n) for n in ("counter-tool", "control", "counter-round", "steps-cut")
    )
    assert parents == {
        f"{tool}.c1": f"{tool}.c0",  # served from its terminal cut, under its own id
        f"{tool}-a1.c2": f"{tool}.c1",
        f"{control}.c1": f"{control}.c0",
        f"{control}-a1.c2": f"{control}.c1",
        f"{round_}.c0": None,  # the first call, served
        f"{round_}-a1.c1": f"{round_}.c0",
        f"{round_}-a1.c2": f"{round_}-a1.c1",
        f"{cut}.c1": f"{cut}.c0",  # the cut, continued under its own id
        f"{cut}-a1.c2": f"{cut}.c1",
    }
    served = {c["call_id"] for c in stats["calls"] if c["served"]}
    assert served == {f"{tool}.c1", f"{control}.c1", f"{round_}.c0"}
    assert stats["parents"] == {"restored": 3, "local": 5}
    assert stats["cuts_refused"] == 0


async def wait_for_checkpoint(service: Service, after: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await committed(service) <= after:
        assert time.monotonic() < deadline, f"no checkpoint after {after}"
        await asyncio.sleep(0.1)
