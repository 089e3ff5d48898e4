"""What rolloutlog costs in real NeMo Gym 0.4.0 servers: latency (p50/p99) and CPU added per
model call, per tool call and per rollout, against the same servers without it.

Two Gyms run side by side in one run, on one fake inference backend (``fake_backend``, the same
for both), with the same rows (``demo_rows``: the counter and ``example_multi_step``, scripted):

- ``baseline``: NeMo Gym's servers as it ships them (stock ``SimpleAgent``, ``vllm_model``,
  resources servers; no ``rolloutlog`` keys), started by the same launcher;
- ``rolloutlog``: the demo's config (``demo_config``): the counter ``exported``, multi_step
  ``stateless``, ``RolloutlogSimpleAgent``s, a streaming ``RolloutlogVLLMModel`` (chunks of
  ``--chunk-tokens``, ledger rows), appending to ``rolloutlog serve`` (embedded), or straight to
  Kafka (Tansu) with a PostgreSQL catalog.

Measured, one request at a time, the two Gyms alternating request by request (so both see the
same machine), after a warm-up:

- ``model_call``: ``POST /v1/responses`` to the policy server (a row's first turn: 64 tokens
  of text, then a tool call); ``model_call_unstreamed``: the same against a second
  ``RolloutlogVLLMModel`` of the instrumented Gym with ``stream: false`` (a ledger row per
  call, no generation chunks), each phase against its own baseline requests;
  ``model_call_paced``: the streamed policy again with the backend generating at
  ``--paced-rate`` tokens/s (a model's pace: a chunk's append overlaps the next tokens'
  generation) instead of ``--token-rate`` (20,000: rolloutlog's own latency laid bare);
- ``tool_call``: ``POST /increment_counter`` to the counter (seeded before, untimed): the
  exported state recorded before the reply leaves;
- ``rollout``: ``POST /run`` to the counter's agent: seed, three model calls, three tool calls,
  verify (the environment's ``episode.started`` before it is untimed, as the collector's).

Latency is the client's wall time; CPU is the user + system time (``/proc``) of the servers the
request went through (the policy; the counter; all five) over the phase, per request, and for
``rolloutlog`` the service's too (its appends, kept apart). Ratios are against the baseline of
the same run. Saved to ``benchmarks/results/nemo_gym_overhead.json`` (``--quick``:
``nemo_gym_overhead_quick.json``, not committed).

    python benchmarks/nemo_gym_overhead.py [--requests 200] [--rollouts 60] \
        [--deployments embedded,kafka] [--token-rate 20000] [--quick]

The NeMo Gym venv is built first if it is not (``make nemo-gym-venv``); Kafka is a Tansu broker
started for the run (or ``ROLLOUTLOG_BENCH_KAFKA``), PostgreSQL ``ROLLOUTLOG_BENCH_POSTGRES``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from _common import DEPLOYMENTS, kafka_broker, percentile, save
from suite_service import Deployment, Service, service

from rolloutlog.integrations.nemo_gym import rollout_cookies, rollout_headers
from rolloutlog.integrations.nemo_gym._processes import FakeBackendProcess, GymProcesses
from rolloutlog.integrations.nemo_gym._venv import ensure_venv
from rolloutlog.integrations.nemo_gym.demo import demo_config, demo_rows
from rolloutlog.participants import (
    Environment,
    HttpTransport,
    KafkaTransport,
    RolloutContext,
    Transport,
)
from rolloutlog.participants.sim import free_port
from rolloutlog.trainer import AsyncTrainerClient

TICKS = os.sysconf("SC_CLK_TCK")
RUN = "nemo-bench"
SERVERS = ("counter", "counter_agent", "steps", "steps_agent", "policy_model")


def cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds, its waited-for children's included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICKS


class Gym:
    """One of the two Gyms: its servers, an HTTP client, and the rollout context (or none)."""

    def __init__(
        self,
        name: str,
        processes: GymProcesses,
        env: Environment | None,
        policy: str = "policy_model",
    ) -> None:
        self.name = name
        self.processes = processes
        self.env = env
        self.policy = policy
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0))
        self.latencies: dict[str, list[float]] = {}
        self.cpu: dict[str, float] = {}
        self.count = 0

    def through(self, kind: str) -> list[int]:
        """The server processes a request of ``kind`` goes through."""
        names = {"model_call": (self.policy,), "tool_call": ("counter",), "rollout": SERVERS}
        return [int(self.processes.state["servers"][n]["pid"]) for n in names[kind]]

    async def context(self, row: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
        """A new episode's headers and cookies (none for the baseline): untimed."""
        if self.env is None:
            return {}, {}
        self.count += 1
        key = f"{self.name}-{self.count}"
        await self.env.start_episode(key, row)
        context = RolloutContext.of(key)
        return rollout_headers(context), rollout_cookies(context)

    async def post(
        self, url: str, body: Any, headers: dict[str, str], cookies: dict[str, str]
    ) -> httpx.Response:
        if cookies:
            headers = {**headers, "cookie": "; ".join(f"{k}={v}" for k, v in cookies.items())}
        reply = await self.http.post(url, json=body, headers=headers)
        reply.raise_for_status()
        return reply

    async def model_call(self, row: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
        headers, cookies = await self.context(row)
        url = self.processes.url(self.policy) + "/v1/responses"
        return lambda: self.post(url, row["responses_create_params"], headers, cookies)

    async def tool_call(self, row: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
        headers, cookies = await self.context(row)
        base = self.processes.url("counter")
        seeded = await self.post(base + "/seed_session", row, headers, cookies)
        cookies = {**cookies, **dict(seeded.cookies)}
        return lambda: self.post(base + "/increment_counter", {"count": 1}, headers, cookies)

    async def rollout(self, row: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
        headers, cookies = await self.context(row)
        url = self.processes.url("counter_agent") + "/run"
        return lambda: self.post(url, row, headers, cookies)

    async def close(self) -> None:
        await self.http.aclose()


async def idle_rates(gyms: list[Gym], svc: Service, seconds: float) -> dict[int, float]:
    """CPU seconds per second each server process (and the service, under its own pid) spends
    with no request in flight (timers, heartbeats, the service's background work): taken out
    of each phase's CPU, so that a phase's length does not count as its requests' cost."""
    pids = {pid for gym in gyms for pid in gym.through("rollout") + gym.through("model_call")}
    assert svc.proc is not None
    pids.add(svc.proc.pid)
    before = {pid: cpu_s(pid) for pid in pids}
    await asyncio.sleep(seconds)
    return {pid: (cpu_s(pid) - before[pid]) / seconds for pid in pids}


async def measure(
    label: str,
    kind: str,
    gyms: list[Gym],
    rows: list[dict[str, Any]],
    count: int,
    warmup: int,
    svc: Service,
    idle: dict[int, float],
) -> None:
    """``count`` requests of ``kind`` per Gym, alternating; latencies and CPU per request
    (less the processes' ``idle`` CPU over the phase) under ``label``."""
    for gym in gyms:
        for row in rows[:warmup]:
            await (await getattr(gym, kind)(row))()
    before = {gym.name: sum(map(cpu_s, gym.through(kind))) for gym in gyms}
    service_before = svc.cpu_s()
    began = time.perf_counter()
    for i in range(count):
        row = rows[i % len(rows)]
        for gym in gyms[i % len(gyms) :] + gyms[: i % len(gyms)]:  # each first in turn
            request = await getattr(gym, kind)(row)
            t0 = time.perf_counter()
            await request()
            gym.latencies.setdefault(label, []).append(time.perf_counter() - t0)
    wall = time.perf_counter() - began
    assert svc.proc is not None
    service_cpu = svc.cpu_s() - service_before - idle[svc.proc.pid] * wall
    for gym in gyms:
        spent = sum(map(cpu_s, gym.through(kind))) - before[gym.name]
        spent -= sum(idle[pid] for pid in gym.through(kind)) * wall
        gym.cpu[label] = spent / count
        if gym.env is not None:
            gym.cpu[label + ".service"] = service_cpu / count


def figures(kind: str, gyms: list[Gym]) -> dict[str, Any]:
    """Each Gym's figures for ``kind``; the instrumented ones' ``added`` over the baseline
    (``gyms[0]``)."""
    entry: dict[str, Any] = {}
    for gym in gyms:
        values = gym.latencies[kind]
        entry[gym.name] = {
            "p50_ms": percentile(values, 50) * 1000,
            "p99_ms": percentile(values, 99) * 1000,
            "requests": len(values),
            "cpu_ms": gym.cpu[kind] * 1000,
        }
    base = entry[gyms[0].name]
    for gym in gyms[1:]:
        ours = entry[gym.name]
        ours["service_cpu_ms"] = gym.cpu[kind + ".service"] * 1000
        ours["added"] = {
            "p50_ms": ours["p50_ms"] - base["p50_ms"],
            "p99_ms": ours["p99_ms"] - base["p99_ms"],
            "cpu_ms": ours["cpu_ms"] - base["cpu_ms"],
            "p50_ratio": ours["p50_ms"] / base["p50_ms"],
            "p99_ratio": ours["p99_ms"] / base["p99_ms"],
            "cpu_ratio": ours["cpu_ms"] / base["cpu_ms"] if base["cpu_ms"] else None,
        }
    return entry


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="rolloutlog-nemo-bench-") as tmp:
        yield Path(tmp)


async def one_deployment(
    deployment: Deployment, svc: Service, python: Path, args: argparse.Namespace
) -> dict[str, Any]:
    with workdir() as tmp:
        backend = FakeBackendProcess(tmp, token_rate=args.token_rate)
        kafka = deployment.log_url
        configs = {
            "baseline": demo_config(svc.url, RUN, backend.url, instrumented=False),
            "rolloutlog": demo_config(
                svc.url, RUN, backend.url, kafka=kafka, chunk_tokens=args.chunk_tokens
            ),
        }
        # the same policy without streaming: a ledger row per call, no generation chunks
        policy = configs["rolloutlog"]["policy_model"]["responses_api_models"]["vllm_model"]
        unstreamed = {**policy, "port": free_port(), "rolloutlog": {**policy["rolloutlog"]}}
        unstreamed["rolloutlog"]["stream"] = False
        configs["rolloutlog"]["policy_unstreamed"] = {
            "responses_api_models": {"vllm_model": unstreamed}
        }
        processes = {name: GymProcesses(python, tmp / name, c) for name, c in configs.items()}
        transport: Transport = (
            KafkaTransport(kafka, url=svc.url) if kafka else HttpTransport(svc.url)
        )
        gyms: list[Gym] = []
        try:
            await backend.start()
            async with AsyncTrainerClient(svc.url) as trainer:
                await trainer.create_run(RUN, partitions=4)
            for gym_processes in processes.values():  # one at a time: 2 cores
                await gym_processes.launch()
            await transport.start()
            env = Environment(transport, RUN, "bench-env")
            await env.register()
            gyms = [
                Gym("baseline", processes["baseline"], None),
                Gym("rolloutlog", processes["rolloutlog"], env),
                Gym("rolloutlog_unstreamed", processes["rolloutlog"], env, "policy_unstreamed"),
            ]
            rows = [r for r in demo_rows(40) if r["agent_ref"]["name"] == "counter_agent"]
            rows = [r for r in rows if r["expected_reward"] == 1.0]
            out: dict[str, Any] = {}
            baseline, streamed, unstreamed = gyms
            phases = [
                ("model_call", "model_call", [baseline, streamed], args.requests),
                ("model_call_unstreamed", "model_call", [baseline, unstreamed], args.requests),
                ("tool_call", "tool_call", [baseline, streamed], args.requests),
                ("rollout", "rollout", [baseline, streamed], args.rollouts),
            ]
            for gym in gyms:  # every server registered and warm before the idle rates
                for kind in ("model_call", "tool_call", "rollout"):
                    await (await getattr(gym, kind)(rows[0]))()
            idle = await idle_rates(gyms, svc, args.idle_s)
            names = {
                int(server["pid"]): f"{name}/{server_name}"
                for name, p in processes.items()
                for server_name, server in p.state["servers"].items()
            }
            assert svc.proc is not None
            names[svc.proc.pid] = "service"
            out["idle_cpu_ms_per_s"] = {names[pid]: rate * 1000 for pid, rate in idle.items()}
            paced = copy.deepcopy(rows)
            for row in paced:
                metadata = row["responses_create_params"]["metadata"]
                metadata["fake_token_rate"] = str(args.paced_rate)
            phases.insert(1, ("model_call_paced", "model_call", [baseline, streamed], args.paced))
            for label, kind, measured, count in phases:
                began = time.perf_counter()
                chosen = paced if label == "model_call_paced" else rows
                await measure(label, kind, measured, chosen, count, args.warmup, svc, idle)
                spent = time.perf_counter() - began
                print(f"  {label}: {count} per Gym in {spent:.1f} s", flush=True)
                out[label] = figures(label, measured)
            return out
        finally:
            for gym in gyms:
                await gym.close()
            with contextlib.suppress(Exception):
                await transport.stop()
            for gym_processes in processes.values():
                gym_processes.stop()
            backend.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="model and tool calls per Gym")
    parser.add_argument("--rollouts", type=int, default=60, help="rollouts per Gym")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--deployments", default="embedded,kafka")
    parser.add_argument("--token-rate", type=float, default=20000.0, help="backend tokens/s")
    parser.add_argument("--chunk-tokens", type=int, default=16)
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle CPU measured over")
    parser.add_argument("--paced", type=int, default=40, help="paced model calls per Gym")
    parser.add_argument(
        "--paced-rate", type=float, default=400.0, help="the paced calls' backend tokens/s"
    )
    parser.add_argument("--quick", action="store_true", help="a short run, saved apart")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rollouts, args.warmup, args.paced = 20, 6, 2, 6
        args.idle_s = 3.0
    python = ensure_venv() / "bin" / "python"
    results: dict[str, Any] = {
        "parameters": {
            k: getattr(args, k)
            for k in (
                "requests",
                "rollouts",
                "warmup",
                "token_rate",
                "chunk_tokens",
                "paced",
                "paced_rate",
            )
        },
        "load_average_before": os.getloadavg(),
        "deployments": {},
    }
    names = args.deployments.split(",")
    with kafka_broker("kafka" in names) as bootstrap:
        for name in names:
            print(f"== {DEPLOYMENTS[name]}", flush=True)
            deployment = Deployment(name, kafka=bootstrap if name == "kafka" else None)
            with service(deployment) as svc:
                figures_ = asyncio.run(one_deployment(deployment, svc, python, args))
            results["deployments"][name] = {"name": DEPLOYMENTS[name], **figures_}
            for kind, entry in figures_.items():
                if kind == "idle_cpu_ms_per_s":
                    continue
                base = entry["baseline"]
                for name, ours in entry.items():
                    if name == "baseline":
                        continue
                    added = ours["added"]
                    print(
                        f"  {kind:<10} {name:<21} p50 {base['p50_ms']:.1f} -> "
                        f"{ours['p50_ms']:.1f} ms (+{added['p50_ms']:.1f}, "
                        f"x{added['p50_ratio']:.2f}), p99 {base['p99_ms']:.1f} -> "
                        f"{ours['p99_ms']:.1f} ms, CPU {base['cpu_ms']:.1f} -> "
                        f"{ours['cpu_ms']:.1f} ms (+ service {ours['service_cpu_ms']:.1f} ms)",
                        flush=True,
                    )
    results["load_average_after"] = os.getloadavg()
    path = save("nemo_gym_overhead_quick" if args.quick else "nemo_gym_overhead", results)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
