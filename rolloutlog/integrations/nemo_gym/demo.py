"""``make demo-nemo-gym`` (``python -m rolloutlog.integrations.nemo_gym.demo``): ``make demo``
with real NeMo Gym 0.4.0 servers.

Builds the NeMo Gym venv on first use (``_venv.ensure_venv``: cached under
``~/.cache/rolloutlog/nemo-gym/``, reused after), starts ``rolloutlog serve`` (embedded log +
SQLite in a temp dir, or ``--log``/``--catalog``), the fake inference backend, and NeMo Gym's
servers from the venv under the launcher, one process group each: the stateful counter
(``example_session_state_mgmt``, exported with the worked example's ``CounterState``),
``example_multi_step``, a ``RolloutlogSimpleAgent`` for each and a streaming
``RolloutlogVLLMModel``. The collector (``GymCollector``, in this process) collects the rows;
mid-flight it checkpoints, every NeMo Gym process group is SIGKILLed, the Gym is launched again
and the collector resumes from the checkpoint (restore, continue, restart), finishes every row
and prints ``make demo``'s report (``DemoReport``). Exits non-zero when a reward is wrong, a
row is lost or one is written twice.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import httpx
import orjson

from rolloutlog.integrations.nemo_gym._collector import (
    CollectionReport,
    GymCollector,
    episode_id,
    materialize_rows,
)
from rolloutlog.integrations.nemo_gym._processes import (
    FakeBackendProcess,
    GymProcesses,
    kill_group,
    spawn,
    wait_http,
)
from rolloutlog.integrations.nemo_gym._rows import counter_row, steps_row
from rolloutlog.integrations.nemo_gym._venv import ensure_venv, find_python
from rolloutlog.participants import HttpTransport, KafkaTransport, Restores, Transport
from rolloutlog.participants.sim import free_port
from rolloutlog.participants.sim.demo import DemoReport
from rolloutlog.trainer import AsyncTrainerClient, CheckpointInfo

__all__ = ["demo_config", "demo_rows", "main", "run_demo"]

AGENT = "rolloutlog.integrations.nemo_gym:RolloutlogSimpleAgent"
POLICY = "rolloutlog.integrations.nemo_gym:RolloutlogVLLMModel"
COUNTER_STATE = "rolloutlog.integrations.nemo_gym.examples.session_counter:CounterState"
#: a wrong script every this many rows (its expected reward is 0.0)
WRONG_EVERY = 5
#: text tokens before each model turn's tool call: a cut there can be continued (one inside
#: tool-call markup regenerates)
FILLER = 64


def demo_config(
    service_url: str,
    run: str,
    backend_url: str,
    *,
    token: str | None = None,
    kafka: str | None = None,
    instrumented: bool = True,
    chunk_tokens: int = 16,
) -> dict[str, Any]:
    """The demo's NeMo Gym config: the counter (exported) and example_multi_step (stateless),
    each behind a SimpleAgent, on one vllm_model. ``instrumented=False``: the same servers as
    NeMo Gym ships them, stock classes and no ``rolloutlog`` keys (the benchmark's baseline).
    ``kafka``: every participant appends straight to it."""

    def agent(resources: str) -> dict[str, Any]:
        inner: dict[str, Any] = {
            "entrypoint": "app.py",
            "port": free_port(),
            "resources_server": {"type": "resources_servers", "name": resources},
            "model_server": {"type": "responses_api_models", "name": "policy_model"},
        }
        if instrumented:
            inner["rolloutlog"] = {"server_class": AGENT}
        return {"responses_api_agents": {"simple_agent": inner}}

    def resources(impl: str, domain: str, rolloutlog: dict[str, Any]) -> dict[str, Any]:
        inner: dict[str, Any] = {"entrypoint": "app.py", "domain": domain, "port": free_port()}
        if instrumented:
            inner["rolloutlog"] = rolloutlog
        return {"resources_servers": {impl: inner}}

    policy: dict[str, Any] = {
        "entrypoint": "app.py",
        "port": free_port(),
        "base_url": backend_url + "/v1",
        "api_key": "fake",
        "model": "fake",
        "return_token_id_information": True,
        "uses_reasoning_parser": False,
    }
    if instrumented:
        policy["rolloutlog"] = {
            "server_class": POLICY,
            "stream": True,
            "chunk_tokens": chunk_tokens,
            "tool_parser": "hermes",
        }
    config: dict[str, Any] = {
        "head_server": {"host": "127.0.0.1", "port": free_port()},
        "counter": resources(
            "example_session_state_mgmt", "agent", {"mode": "exported", "state": COUNTER_STATE}
        ),
        "counter_agent": agent("counter"),
        "steps": resources(
            "example_multi_step", "instruction_following", {"mode": "stateless", "verify": "replay"}
        ),
        "steps_agent": agent("steps"),
        "policy_model": {"responses_api_models": {"vllm_model": policy}},
    }
    if instrumented:
        config["rolloutlog"] = {"url": service_url, "run": run}
        if token is not None:
            config["rolloutlog"]["token"] = token
        if kafka is not None:
            config["rolloutlog"]["kafka"] = kafka
    return config


def demo_rows(count: int, filler: int = FILLER) -> list[dict[str, Any]]:
    """``count`` materialized rows, counters and multi-step alternating (every
    ``WRONG_EVERY``-th row's script is wrong: its reward is 0.0), each with ``expected_reward``;
    each model turn starts with ``filler`` tokens of text."""
    raw = []
    for i in range(count):
        right = i % WRONG_EVERY != WRONG_EVERY - 1
        row = counter_row(i, right=right) if i % 2 == 0 else steps_row(i, right=right)
        row["responses_create_params"]["metadata"]["fake_tokens"] = str(filler)
        raw.append(orjson.dumps({**row, "expected_reward": 1.0 if right else 0.0}))
    return materialize_rows(raw)


class _Service:
    """``rolloutlog serve`` in its own process group."""

    def __init__(self, workdir: Path, log_url: str | None, catalog_url: str | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "rolloutlog.api.cli", "serve"]
        command += ["--data-dir", str(workdir / "service"), "--port", str(self.port)]
        if log_url:
            command += ["--log", log_url]
        if catalog_url:
            command += ["--catalog", catalog_url]
        self.proc = spawn(command, workdir / "logs" / "service.log")

    async def start(self) -> None:
        await wait_http(self.url + "/readyz", timeout_s=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except Exception:
                kill_group(self.proc.pid)
                self.proc.wait()


class _Demo:
    """One demo run's processes and clients (``run_demo``)."""

    def __init__(
        self,
        workdir: Path,
        *,
        run: str,
        log_url: str | None,
        catalog_url: str | None,
        transport: str,
        token_rate: float,
    ) -> None:
        self.workdir = workdir
        self.run = run
        self.kafka = log_url if transport == "kafka" else None
        self.service = _Service(workdir, log_url, catalog_url)
        self.backend = FakeBackendProcess(workdir, token_rate=token_rate)
        self.output = workdir / "rollouts.jsonl"
        self.gym: GymProcesses | None = None

    def transport(self) -> Transport:
        if self.kafka is not None:
            return KafkaTransport(self.kafka, url=self.service.url)
        return HttpTransport(self.service.url)

    async def collect(
        self, rows: list[dict[str, Any]], concurrency: int, started: asyncio.Event | None = None
    ) -> tuple[CollectionReport, GymCollector]:
        """One collector run over ``rows`` (``started``: set once it dispatches)."""
        assert self.gym is not None
        agents = {name: self.gym.url(name) for name in ("counter_agent", "steps_agent")}
        async with (
            self.transport() as transport,
            AsyncTrainerClient(self.service.url) as trainer,
            Restores(self.service.url) as restores,
        ):
            collector = GymCollector(
                run=self.run,
                agents=agents,
                output=self.output,
                transport=transport,
                trainer=trainer,
                restores=restores,
                concurrency=concurrency,
                signals=False,
            )
            self.collector = collector
            try:
                task = asyncio.create_task(collector.run(rows))
                if started is not None:
                    started.set()
                return await task, collector
            finally:
                await collector.close()

    def written(self) -> list[dict[str, Any]]:
        if not self.output.exists():
            return []
        return [orjson.loads(line) for line in self.output.read_bytes().splitlines() if line]

    async def policy_stats(self) -> dict[str, Any]:
        assert self.gym is not None
        async with httpx.AsyncClient(timeout=30) as client:
            url = self.gym.url("policy_model") + "/rolloutlog/stats"
            stats: dict[str, Any] = (await client.get(url)).json()
        return stats


def _say(out: TextIO, text: str) -> None:
    out.write(text + "\n")
    out.flush()


async def _wait_mid_flight(
    demo: _Demo, written: int, generating: int, runner: asyncio.Task[Any], timeout_s: float = 10.0
) -> None:
    """Until ``written`` rows are written and ``generating`` model calls past a row's first
    turn are generating (rows mid-rollout; the second condition is given up after
    ``timeout_s``)."""
    deadline = None
    while True:
        if runner.done():
            runner.result()
            raise RuntimeError("the collection ended before the checkpoint")
        if len(demo.written()) >= written:
            deadline = deadline or time.monotonic() + timeout_s
            calls = demo.backend.calls()
            busy = [c for c in calls if "generated" not in c and c.get("turn", 0) >= 1]
            if len(busy) >= generating or time.monotonic() > deadline:
                return
        await asyncio.sleep(0.05)


async def run_demo(
    rows: int = 24,
    *,
    concurrency: int = 8,
    checkpoint_after: float = 0.3,
    data_dir: Path | None = None,
    log_url: str | None = None,
    catalog_url: str | None = None,
    transport: str = "http",
    run: str | None = None,
    token_rate: float = 300.0,
    out: TextIO | None = None,
) -> DemoReport:
    """Run the demo in ``data_dir`` (default: a temporary directory, removed); its report.
    ``run``: the rolloutlog run (default: a new name, so a kept catalog never resumes an older
    demo's run)."""
    out = out or sys.stdout
    began = time.perf_counter()
    python = find_python()
    if python is None:
        raise SystemExit("no Python >= 3.12 for NeMo Gym (pyenv, PATH, ROLLOUTLOG_NEMO_GYM_PYTHON)")
    venv_python = ensure_venv(python) / "bin" / "python"
    began = time.perf_counter()  # the venv's first build is not the demo's time
    with tempfile.TemporaryDirectory(prefix="rolloutlog-nemo-gym-") as tmp:
        workdir = Path(data_dir) if data_dir is not None else Path(tmp)
        demo = _Demo(
            workdir,
            run=run or f"demo-nemo-gym-{uuid.uuid4().hex[:8]}",
            log_url=log_url,
            catalog_url=catalog_url,
            transport=transport,
            token_rate=token_rate,
        )
        try:
            return await _run(demo, venv_python, rows, concurrency, checkpoint_after, began, out)
        finally:
            if demo.gym is not None:
                demo.gym.stop()
            demo.backend.stop()
            demo.service.stop()


async def _run(
    demo: _Demo,
    venv_python: Path,
    count: int,
    concurrency: int,
    checkpoint_after: float,
    began: float,
    out: TextIO,
) -> DemoReport:
    timings: dict[str, float] = {}
    rows = demo_rows(count)
    _say(
        out,
        f"rolloutlog NeMo Gym demo: {count} rows, {concurrency} at a time, real NeMo Gym 0.4.0 "
        "servers (counter exported, multi_step, 2 SimpleAgents, a vllm_model) on a fake backend",
    )
    config = demo_config(demo.service.url, demo.run, demo.backend.url, kafka=demo.kafka)
    demo.gym = GymProcesses(venv_python, demo.workdir / "gym", config)
    # the Gym's servers register with the service on their first rollout request: all three
    # start at once
    launch = asyncio.create_task(demo.gym.launch())
    try:
        await asyncio.gather(demo.service.start(), demo.backend.start())
        async with AsyncTrainerClient(demo.service.url) as trainer:
            await trainer.create_run(demo.run, partitions=4)
    finally:
        await launch
    _say(
        out,
        f"service ({demo.service.url}), backend and {len(demo.gym.groups()) - 1} NeMo Gym "
        f"servers ready in {time.perf_counter() - began:.1f} s",
    )
    _say(out, f"dashboard while the demo runs: {demo.service.url}/ui")

    # The first collection: a checkpoint mid-flight, then SIGKILL of every NeMo Gym group.
    runner = asyncio.create_task(demo.collect(rows, concurrency))
    await _wait_mid_flight(
        demo, max(1, int(count * checkpoint_after)), max(1, concurrency // 2), runner
    )
    t0 = time.perf_counter()
    checkpoint: CheckpointInfo | None = await demo.collector.checkpoint("demo")
    timings["checkpoint_s"] = time.perf_counter() - t0
    assert checkpoint is not None
    _say(
        out,
        f"checkpoint {checkpoint.checkpoint_id} {checkpoint.status} in "
        f"{timings['checkpoint_s'] * 1000:.0f} ms: {dict(checkpoint.counts)}",
    )
    groups = len(demo.gym.groups())
    demo.gym.kill()
    first, _ = await runner
    _say(
        out,
        f"SIGKILLed {groups} NeMo Gym process groups; {len(demo.written())} rows written, "
        f"{len(first.interrupted)} interrupted",
    )

    # The Gym again; the same collection resumes from the checkpoint.
    t0 = time.perf_counter()
    await demo.gym.launch()
    timings["restart_s"] = time.perf_counter() - t0
    _say(out, f"NeMo Gym servers launched again in {timings['restart_s']:.1f} s")
    second, _ = await demo.collect(rows, concurrency)
    plan = second.plan
    assert plan is not None and plan.restore is not None
    _say(
        out,
        f"restore {plan.restore_id} of checkpoint {plan.checkpoint_id} in "
        f"{second.resume_s * 1000:.0f} ms: {dict(plan.restore.counts)}",
    )
    stats = await demo.policy_stats()
    resumed = _resumed(await _projections(demo, second))
    timings["total_s"] = time.perf_counter() - began
    report = _report(demo, rows, second, stats, checkpoint, resumed, timings)
    report.write(out)
    return report


def _report(
    demo: _Demo,
    rows: list[dict[str, Any]],
    second: CollectionReport,
    stats: Mapping[str, Any],
    checkpoint: CheckpointInfo,
    resumed: tuple[dict[str, int], int],
    timings: Mapping[str, float],
) -> DemoReport:
    """The report's figures: every row once with its expected reward, or it is not right."""
    expected = {episode_id(row): float(row["expected_reward"]) for row in rows}
    written = demo.written()
    times = Counter(episode_id(row) for row in written)
    rewards = {episode_id(row): float(row["reward"]) for row in written}
    twice = sorted(e for e, n in times.items() if n > 1)
    wrong = sorted(e for e, r in rewards.items() if r != expected.get(e))
    failures = demo.output.with_name(demo.output.stem + "_failures.jsonl")
    failed = [
        episode_id(orjson.loads(line))
        for line in (failures.read_bytes().splitlines() if failures.exists() else [])
        if line
    ]
    calls = stats.get("calls", [])
    cuts = [c for c in calls if c.get("continued") or c.get("served")]
    cut_tokens = sum(int(c["tokens"] if c.get("served") else c["continued"]) for c in cuts)
    parents = dict(stats.get("parents", {}))
    plan = second.plan
    assert plan is not None and plan.restore is not None
    report = DemoReport(
        rollouts=len(rows),
        finished=len(times),
        continued=second.continued,
        restarted=second.restarted,
        resumed_at=resumed[0],
        cut_calls=len(cuts),
        cut_tokens=cut_tokens,
        right=sum(e not in wrong and times[e] == 1 for e in rewards),
        recovered=second.recovered,
        lost=sorted(set(expected) - set(times) - set(failed)),
        failed=failed,
        wrong=wrong + twice,
        checkpoint_s=timings["checkpoint_s"],
        checkpoint_service_ms=checkpoint.timings_ms,
        restore_s=second.resume_s,
        restore_service_ms=plan.restore.timings_ms,
        participants_restart_s=timings["restart_s"],
        total_s=timings["total_s"],
        counter_restored=resumed[1],
        policy_workers=1,
        parents_other_worker=0,
        extra=[
            (
                "lineage parents",
                f"{parents.get('restored', 0)} among restored rows, {parents.get('local', 0)} "
                f"local, {parents.get('none', 0)} none",
            ),
            ("written twice", str(len(twice))),
        ],
        title="rolloutlog demo report (NeMo Gym 0.4.0)",
    )
    return report


async def _projections(demo: _Demo, second: CollectionReport) -> list[dict[str, Any]]:
    """The projections the continued rows resumed from."""
    plan = second.plan
    if plan is None or plan.restore_id is None:
        return []
    async with Restores(demo.service.url) as restores:
        return [
            await restores.fetch(demo.run, dispatch.episode, plan.restore_id) or {}
            for dispatch in plan.continued
        ]


def _resumed(projections: Sequence[Mapping[str, Any]]) -> tuple[dict[str, int], int]:
    """Where the continued rows resumed (the agent's last boundary: before a model call or
    after a tool round; the start of ``/run`` without one), and how many held the counter's
    exported state (what the counter server restored for their replacement attempts)."""
    stages: Counter[str] = Counter()
    counters = 0
    for projection in projections:
        agent = [
            boundary
            for sid, boundary in projection.get("boundaries", {}).items()
            if sid.endswith("_agent:" + projection.get("episode", ""))
        ]
        stages[str(agent[0]["stage"]) if agent else "invoke_agent"] += 1
        for session in projection.get("sessions", {}).values():
            state = session.get("state")
            if session.get("participant") == "counter" and isinstance(state, dict):
                counters += state.get("state") is not None
    return dict(stages), counters


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rolloutlog.integrations.nemo_gym.demo")
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--data-dir", help="keep the run's files here (default: a temp dir)")
    parser.add_argument("--log", dest="log_url", help="log URL, e.g. kafka://host:9092")
    parser.add_argument("--catalog", dest="catalog_url", help="postgresql+asyncpg://…")
    parser.add_argument(
        "--transport",
        choices=["http", "kafka"],
        default="http",
        help="how the Gym's participants append: through the service, or straight to Kafka",
    )
    parser.add_argument("--token-rate", type=float, default=300.0, help="backend tokens/s")
    parser.add_argument("--run", help="the rolloutlog run (default: a new name)")
    args = parser.parse_args(argv)
    report = asyncio.run(
        run_demo(
            args.rows,
            concurrency=args.concurrency,
            data_dir=Path(args.data_dir) if args.data_dir else None,
            log_url=args.log_url,
            catalog_url=args.catalog_url,
            transport=args.transport,
            token_rate=args.token_rate,
            run=args.run,
        )
    )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
