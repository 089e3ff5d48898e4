"""``make demo`` (``python -m rolloutlog.participants.sim.demo``): the whole mission in one command.

Starts the service (embedded log + SQLite in a temp dir, or ``--log``/``--catalog``) and the six
simulated participant processes, runs a few hundred rollouts, checkpoints mid-flight, SIGKILLs
every participant, restores, starts them again, finishes every rollout and prints a report.
Exits non-zero when a reward is wrong or a rollout is lost.

``--policy-workers N`` runs the policy server as N worker processes (a shared ledger; the agent
alternates between them), ``--kill-service`` also SIGKILLs the service after the restore, with
rollouts in flight, and starts it again ``--service-down`` seconds later: the participants ride
through (their appends retry under their deadline).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rolloutlog.participants.sim._collector import Collector, CollectorReport
from rolloutlog.participants.sim._gym import PARTICIPANTS, Gym
from rolloutlog.participants.sim._model import make_tasks

__all__ = ["DemoReport", "DemoResult", "main", "run_demo"]


@dataclass
class DemoResult:
    report: CollectorReport
    timings: dict[str, float] = field(default_factory=dict)
    restore_counts: dict[str, int] = field(default_factory=dict)
    checkpoint_counts: dict[str, int] = field(default_factory=dict)
    #: each participant's ``/sim/stats`` at the end (replacement processes'), by name
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: ``--fork``: the fork's report (its rollouts continued beside the run's)
    fork: CollectorReport | None = None
    #: the run the report is of (the participants' stats also hold a fork's rollouts)
    run: str = "demo"

    @property
    def ok(self) -> bool:
        return self.report.ok and (self.fork is None or self.fork.ok)


class _Progress:
    """One status line, redrawn in place on a terminal, every few seconds otherwise."""

    def __init__(self, out: TextIO, total: int) -> None:
        self.out = out
        self.total = total
        self.tty = out.isatty()
        self.last = 0.0
        self.began = time.perf_counter()

    def __call__(self, collector: Collector) -> None:
        now = time.perf_counter()
        if now - self.last < (0.1 if self.tty else 2.0):
            return
        self.last = now
        self.draw(collector)

    def draw(self, collector: Collector) -> None:
        counts = collector.counts()
        done = counts["done"]
        width = 30
        bar = "#" * (width * done // max(self.total, 1))
        line = (
            f"  [{bar:<{width}}] {done}/{self.total} done, {counts['running']} in flight, "
            f"{counts['interrupted']} interrupted  {time.perf_counter() - self.began:5.1f}s"
        )
        if self.tty:
            self.out.write("\r" + line)
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def say(self, text: str) -> None:
        if self.tty:
            self.out.write("\r\033[K")
        self.out.write(text + "\n")
        self.out.flush()


async def run_demo(
    rollouts: int = 300,
    *,
    concurrency: int = 32,
    checkpoint_after: float = 0.3,
    data_dir: str | Path | None = None,
    log_url: str | None = None,
    catalog_url: str | None = None,
    participant_transport: str = "http",
    run: str = "demo",
    rounds: int = 2,
    tokens: int = 12,
    long_tokens: int = 64,
    policy_workers: int = 1,
    kill_service: bool = False,
    service_down_s: float = 5.0,
    fork_policy_version: int | None = None,
    out: TextIO | None = None,
) -> DemoResult:
    """Run the demo; returns the collector's report with the checkpoint and restore figures."""
    out = out or sys.stdout
    progress = _Progress(out, rollouts)
    timings: dict[str, float] = {}
    began = time.perf_counter()
    progress.say(
        f"rolloutlog demo: {rollouts} rollouts, {concurrency} at a time, "
        f"{len(PARTICIPANTS)} participant processes ({', '.join(PARTICIPANTS)})"
    )
    gym = Gym(
        data_dir,
        run=run,
        log_url=log_url,
        catalog_url=catalog_url,
        participant_transport=participant_transport,
        policy_workers=policy_workers,
        fork_policy_version=fork_policy_version,
    )
    fork_report: CollectorReport | None = None
    async with gym:
        timings["start_s"] = gym.timings["start_s"]
        progress.say(
            f"service ({gym.service_url}) and participants ready in {timings['start_s']:.1f} s"
        )
        progress.say(f"dashboard while the demo runs: {gym.service_url}/ui")
        tasks = make_tasks(
            rollouts,
            rounds=rounds,
            tokens=tokens,
            constrained_every=7,
            long_every=4,
            long_tokens=long_tokens,
            long_token_rate=400.0,  # slow enough that some are mid-generation at the checkpoint
        )
        async with gym.collector(concurrency=concurrency, on_progress=progress) as collector:
            runner = asyncio.create_task(collector.run(tasks, timeout_s=300))
            await collector.wait_done(int(rollouts * checkpoint_after))
            t0 = time.perf_counter()
            checkpoint = await collector.checkpoint(pause=True)
            timings["checkpoint_s"] = time.perf_counter() - t0
            progress.say(
                f"checkpoint {checkpoint.checkpoint_id} {checkpoint.status} in "
                f"{timings['checkpoint_s'] * 1000:.0f} ms: {dict(checkpoint.counts)}"
            )
            forked: list[dict[str, Any]] = []
            if fork_policy_version is not None:
                forked = await _fork(collector, run, checkpoint.checkpoint_id, tasks, progress)
            gym.kill_participants()
            progress.say(f"SIGKILLed {len(PARTICIPANTS)} participant process groups")
            t0 = time.perf_counter()
            plan = await collector.restore()
            timings["restore_s"] = time.perf_counter() - t0
            assert plan.restore is not None
            progress.say(
                f"restore {plan.restore_id} of checkpoint {plan.checkpoint_id} in "
                f"{timings['restore_s'] * 1000:.0f} ms: {dict(plan.restore.counts)}"
            )
            t0 = time.perf_counter()
            await gym.start_participants(plan.restore_id)
            timings["participants_restart_s"] = time.perf_counter() - t0
            progress.say(f"participants restarted in {timings['participants_restart_s']:.1f} s")
            collector.redispatch()
            branch: Collector | None = None
            if fork_policy_version is not None:
                # The fork's rollouts go on beside the run's, in the same participant processes.
                branch = gym.collector(f"{run}-fork", concurrency=concurrency)
                await branch.setup()
                branch.adopt(forked)
                await branch.restore()
                branch.redispatch()
                fork_runner = asyncio.create_task(branch.run(timeout_s=300))
            if kill_service:
                # mid-run: replacement rollouts (and new ones) in flight
                left = rollouts - collector.counts()["done"]
                await collector.wait_done(rollouts - left * 2 // 3)
                gym.kill_service()
                progress.say(
                    f"SIGKILLed the service with {collector.counts()['running']} rollouts in "
                    f"flight; starting it again in {service_down_s:.0f} s"
                )
                t0 = time.perf_counter()
                await asyncio.sleep(service_down_s)
                await gym.start_service()
                timings["service_down_s"] = time.perf_counter() - t0
                progress.say(f"service back after {timings['service_down_s']:.1f} s")
            report = await runner
            if branch is not None:
                fork_report = await fork_runner
                await branch.close()
                progress.say(
                    f"fork {run}-fork (policy version {fork_policy_version}): "
                    f"{fork_report.right}/{fork_report.rollouts} right, "
                    f"{fork_report.continued} continued, {fork_report.restarted} restarted"
                )
            progress.draw(collector)
            if progress.tty:
                out.write("\n")
        stats = {name: await gym.stats(name) for name in PARTICIPANTS}
    timings["total_s"] = time.perf_counter() - began
    result = DemoResult(
        report, timings, dict(plan.restore.counts), dict(checkpoint.counts), stats, fork_report, run
    )
    _print_report(out, result)
    return result


async def _fork(
    collector: Collector,
    run: str,
    checkpoint_id: int,
    tasks: Sequence[dict[str, Any]],
    progress: _Progress,
) -> list[dict[str, Any]]:
    """Fork the run at the checkpoint (``--fork``): its live episodes but the sandbox's (whose
    server serves its own run only); the forked episodes' tasks."""
    trainer = collector.trainer
    manifest = {e["episode"]: e["action"] async for e in trainer.manifest(run, checkpoint_id)}
    by_id = {str(task["id"]): task for task in tasks}
    live = [by_id[e] for e, action in manifest.items() if action != "finished" and e in by_id]
    sandboxed = sorted(str(t["id"]) for t in live if t["resources"] == "sandbox")
    created = await trainer.fork_run(f"{run}-fork", run, checkpoint_id, exclude=sandboxed or None)
    progress.say(f"forked {run}-fork from checkpoint {checkpoint_id}: {created.get('counts')}")
    return [t for t in live if t["resources"] != "sandbox"]


@dataclass
class DemoReport:
    """What the demo report prints (``lines()``): ``make demo`` fills it from the simulated Gym,
    ``make demo-nemo-gym`` from real NeMo Gym servers. A figure that is None has no line
    (a Gym without that participant); ``extra`` lines follow the policy's."""

    rollouts: int
    finished: int
    continued: int
    restarted: int
    #: resumed episodes by the stage they resumed at
    resumed_at: Mapping[str, int]
    #: calls continued or served from a generation cut, and the tokens not generated again
    cut_calls: int
    cut_tokens: int
    right: int
    recovered: int
    lost: Sequence[str]
    failed: Sequence[str]
    wrong: Sequence[str]
    checkpoint_s: float
    checkpoint_service_ms: Mapping[str, Any]
    restore_s: float
    restore_service_ms: Mapping[str, Any]
    participants_restart_s: float
    total_s: float
    sandbox_restored: int | None = None
    counter_restored: int | None = None
    policy_workers: int = 1
    parents_other_worker: int = 0
    extra: Sequence[tuple[str, str]] = ()
    service_down_s: float | None = None
    appends_retried: int = 0
    title: str = "rolloutlog demo report"

    @property
    def ok(self) -> bool:
        """Every rollout finished with its expected reward."""
        return self.finished == self.rollouts == self.right

    def lines(self) -> list[str]:
        def line(label: str, value: str) -> str:
            return f"  {label:<22} {value}"

        resumed = ", ".join(f"{stage} {n}" for stage, n in self.resumed_at.items()) or "-"
        optional = [
            (
                "sandbox sessions",
                self.sandbox_restored,
                "restored (exported when the checkpoint asked)",
            ),
            ("counter states", self.counter_restored, "restored"),
        ]
        return [
            "",
            self.title,
            line("rollouts finished", f"{self.finished}/{self.rollouts}"),
            line("  continued", f"{self.continued} (from their last boundary)"),
            line("  restarted", f"{self.restarted} (from their input, one attempt later)"),
            line("resumed at", resumed),
            line(
                "generation cuts",
                f"{self.cut_calls} calls continued, {self.cut_tokens} tokens not generated again",
            ),
            *(line(label, f"{n} {what}") for label, n, what in optional if n is not None),
            line(
                "policy workers",
                f"{self.policy_workers}: {self.parents_other_worker} calls' parents resolved on "
                "another worker",
            ),
            *(line(label, value) for label, value in self.extra),
            line("rewards right", f"{self.right}/{self.rollouts}"),
            line("results recovered", f"{self.recovered} (after the crash)"),
            line("lost", str(len(self.lost))),
            line("failed", str(len(self.failed))),
            line(
                "checkpoint",
                f"{self.checkpoint_s * 1000:.0f} ms round trip "
                f"(service: {_ms(self.checkpoint_service_ms)})",
            ),
            line(
                "restore",
                f"{self.restore_s * 1000:.0f} ms round trip "
                f"(service: {_ms(self.restore_service_ms)})",
            ),
            line("participants restart", f"{self.participants_restart_s:.1f} s"),
            *(
                [
                    line(
                        "service killed",
                        f"back after {self.service_down_s:.1f} s; participants retried "
                        f"{self.appends_retried} appends and rode through",
                    )
                ]
                if self.service_down_s is not None
                else []
            ),
            line("total", f"{self.total_s:.1f} s"),
            "  OK"
            if self.ok
            else f"  FAILED: wrong {list(self.wrong)[:10]} lost {list(self.lost)[:10]} "
            f"failed {list(self.failed)[:10]}",
        ]

    def write(self, out: TextIO) -> None:
        out.write("\n".join(self.lines()) + "\n")
        out.flush()


def _print_report(out: TextIO, result: DemoResult) -> None:
    report, timings = result.report, result.timings
    checkpoint = report.checkpoints[0]
    restore = report.restores[0].restore
    sandbox = result.stats.get("sandbox", {}).get("restored", {})
    calls = result.stats.get("policy", {}).get("calls", [])
    cuts = [c for c in calls if c["continued"] or c["terminal_cut"]]
    restored = result.stats.get("counter", {}).get("restored", {})
    policy = result.stats.get("policy", {})
    retried = sum(stats.get("appends_retried", 0) for stats in result.stats.values())
    resumed = [
        r
        for r in result.stats.get("environment", {}).get("runs", [])
        if r["resumed_stage"] and r.get("run", result.run) == result.run
    ]
    DemoReport(
        rollouts=report.rollouts,
        finished=report.finished,
        continued=report.continued,
        restarted=report.restarted,
        resumed_at=_stages(resumed),
        cut_calls=len(cuts),
        cut_tokens=sum(c["continued"] for c in cuts),
        right=report.right,
        recovered=len(report.recovered),
        lost=report.lost,
        failed=report.failed,
        wrong=report.wrong,
        checkpoint_s=timings["checkpoint_s"],
        checkpoint_service_ms=checkpoint.timings_ms,
        restore_s=timings["restore_s"],
        restore_service_ms=restore.timings_ms if restore else {},
        participants_restart_s=timings["participants_restart_s"],
        total_s=timings["total_s"],
        sandbox_restored=sum(v is not None for v in sandbox.values()),
        counter_restored=sum(v is not None for v in restored.values()),
        policy_workers=len(policy.get("workers", [])) or 1,
        parents_other_worker=policy.get("parents", {}).get("other_worker", 0),
        service_down_s=timings.get("service_down_s"),
        appends_retried=retried,
    ).write(out)


def _stages(runs: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for run in runs:
        counts[run["resumed_stage"]] = counts.get(run["resumed_stage"], 0) + 1
    return counts


def _ms(timings: Any) -> str:
    total = timings.get("total") if hasattr(timings, "get") else None
    if total is None and timings:
        total = sum(float(v) for v in timings.values())
    return "n/a" if total is None else f"{float(total):.0f} ms"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rolloutlog.participants.sim.demo")
    parser.add_argument("--rollouts", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--data-dir", help="default: a temporary directory, removed afterwards")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the data (in a new directory unless --data-dir) and print how to browse it",
    )
    parser.add_argument("--log", dest="log_url", help="log URL, e.g. kafka://host:9092")
    parser.add_argument("--catalog", dest="catalog_url", help="postgresql+asyncpg://…")
    parser.add_argument(
        "--transport",
        choices=["http", "kafka"],
        default="http",
        help="how participants append: through the service, or straight to Kafka (--log)",
    )
    parser.add_argument(
        "--policy-workers", type=int, default=1, help="policy server worker processes"
    )
    parser.add_argument(
        "--kill-service",
        action="store_true",
        help="also SIGKILL the service mid-run and start it again (participants ride through)",
    )
    parser.add_argument(
        "--service-down", type=float, default=5.0, help="seconds the killed service stays down"
    )
    parser.add_argument(
        "--fork",
        type=int,
        metavar="POLICY_VERSION",
        dest="fork_policy_version",
        help="also fork the run at its checkpoint and continue the fork beside it, in the same "
        "participant processes, under this policy version",
    )
    args = parser.parse_args(argv)
    data_dir = args.data_dir
    if data_dir is None and args.keep:
        data_dir = tempfile.mkdtemp(prefix="rolloutlog-demo-")
    result = asyncio.run(
        run_demo(
            args.rollouts,
            concurrency=args.concurrency,
            data_dir=data_dir,
            log_url=args.log_url,
            catalog_url=args.catalog_url,
            participant_transport=args.transport,
            policy_workers=args.policy_workers,
            kill_service=args.kill_service,
            service_down_s=args.service_down,
            fork_policy_version=args.fork_policy_version,
        )
    )
    if data_dir is not None:
        service_dir = Path(data_dir) / "service"
        where = f"--data-dir {service_dir}"
        if args.log_url:
            where += f" --log {args.log_url}"
        if args.catalog_url:
            where += f" --catalog {args.catalog_url}"
        # The venv's command when the demo runs from one (``make demo``), else the one on PATH.
        command = Path(sys.executable).parent / "rolloutlog"
        serve = f"{command if command.exists() else 'rolloutlog'} serve {where}"
        sys.stdout.write(
            f"\nThe demo's data is kept in {data_dir}. To browse it in the dashboard:\n"
            f"  {serve}\n"
            f"  then open http://127.0.0.1:8750/ui\n"
        )
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
