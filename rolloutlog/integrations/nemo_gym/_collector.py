"""Rollout collection for NeMo Gym with checkpoints: ``ng_collect_rollouts``' files, resumable.

``GymCollector`` reads NeMo Gym's dataset JSONL (rows materialized as ``ng_collect_rollouts``
does: ``agent_ref``, ``_ng_task_index`` over identical rows, ``_ng_rollout_index`` per repeat),
posts each row to its agent's ``POST /run`` and writes NeMo Gym's rollout JSONL (the ``/run``
reply plus the row's indices and ``agent_ref``; refused rows go to ``<out>_failures.jsonl``).

It plays the environment's part, which NeMo Gym 0.4.0 leaves to the agent's ``/run``: each row is
an episode (``t<task>-r<rollout>``) started with the row as its task (the restore checks its
digest), a ``step.started`` for ``invoke_agent`` (replay) before ``/run``, a boundary with the
reply after it, and ``episode.finished`` (reward, the rollout row) before the row is written.
The rollout context goes to ``/run`` as headers and cookies (``_context``).

Checkpoints: on a timer (``checkpoint_every_s``), on SIGUSR1 (and go on), on SIGTERM (and stop)
(``rolloutlog.trainer.CheckpointScheduler``), and once before the first dispatch of a run, so a
crash always has a checkpoint to restore. Started again on the same run and output, it resumes:
``resume_run`` restores the latest checkpoint; rows already in the output are done, finished
rows whose reply was lost come back as results (written, then acknowledged), ``continue`` rows
resume from their projection (an agent with session hooks resumes its loop; the stock one
replays ``/run``), ``restart`` rows start over one attempt later, the rest start fresh. Rows are
acknowledged (``ack_results``) once they are written and synced to disk.

A fork (``fork_from``: the source run, ``fork_checkpoint``: its checkpoint; README "Resume a
fork") is created by the first ``run`` (``fork_run``; the same fork again is a no-op) and resumed
like a crash: its forked rows continue in it as its next attempt, into its own output; the
dataset's other rows are not the fork's (``not_forked``), so they are left out. A run that is a
fork is resumed the same way without ``fork_from``.

A ``/run`` that fails without a reply (the Gym died: a connection error or a 5xx) interrupts the
collection: dispatch stops, the rows in flight end, and ``run`` returns with ``interrupted`` set
(the command exits 3): start the Gym again and run the same command to resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from rolloutlog.errors import RunExists
from rolloutlog.integrations.nemo_gym._context import rollout_cookies, rollout_headers
from rolloutlog.participants import Environment, EnvironmentEpisode, Restores, RolloutContext
from rolloutlog.participants import Transport as _Transport
from rolloutlog.trainer import (
    AsyncTrainerClient,
    CheckpointInfo,
    CheckpointScheduler,
    ResumePlan,
    resume_run,
)

__all__ = [
    "AGENT_REF",
    "ROLLOUT_INDEX",
    "TASK_INDEX",
    "CollectionReport",
    "GymCollector",
    "episode_id",
    "materialize_rows",
    "summary",
]

TASK_INDEX = "_ng_task_index"
ROLLOUT_INDEX = "_ng_rollout_index"
AGENT_REF = "agent_ref"
FAILURE_CLASS = "_ng_failure_class"
FAILURE_REASON = "_ng_failure_reason"


def materialize_rows(
    lines: Iterable[str | bytes],
    *,
    agent: str | None = None,
    limit: int | None = None,
    num_repeats: int = 1,
) -> list[dict[str, Any]]:
    """Dataset rows as ``ng_collect_rollouts`` runs them: ``agent_ref`` (``agent`` for rows
    without one), ``_ng_task_index`` (identical rows share one; a given one is kept) and
    ``_ng_rollout_index`` (0..num_repeats-1), repeats adjacent (aabbcc)."""
    task_of: dict[bytes, int] = {}
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(lines):
        if limit is not None and number >= limit:
            break
        raw = line.encode() if isinstance(line, str) else line
        if not raw.strip():
            continue
        row = orjson.loads(raw)
        if agent is not None:
            row.setdefault(AGENT_REF, {"name": agent})
        if not (row.get(AGENT_REF) or {}).get("name"):
            raise ValueError(f"row {number}: no agent_ref and no agent given")
        if TASK_INDEX not in row:
            row[TASK_INDEX] = task_of.setdefault(raw.strip(), len(task_of))
        for repeat in range(num_repeats):
            rows.append({**row, ROLLOUT_INDEX: repeat})
    return rows


def episode_id(row: Mapping[str, Any]) -> str:
    """The episode of a materialized row: ``t<task index>-r<rollout index>``."""
    return f"t{row[TASK_INDEX]}-r{row[ROLLOUT_INDEX]}"


@dataclass
class CollectionReport:
    """What one ``run`` did (``interrupted``: rows whose ``/run`` failed without a reply)."""

    rows: int
    written: int = 0
    recovered: int = 0
    continued: int = 0
    restarted: int = 0
    failed: int = 0
    already_done: int = 0
    #: rows of a fork's dataset that its source did not hand it (finished, or not started)
    not_forked: int = 0
    checkpoints: list[int] = field(default_factory=list)
    restore_id: int | None = None
    interrupted: list[str] = field(default_factory=list)
    stopped: bool = False
    #: the resume this run started from, and how long ``resume_run`` took
    plan: ResumePlan | None = None
    resume_s: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.interrupted and not self.stopped


@dataclass
class _Rollout:
    row: dict[str, Any]
    episode: str
    capture_key: str
    action: str = "fresh"


class _Output:
    """The rollout JSONL and its failures sidecar, appended; ``sync`` makes rows durable."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.failures_path = path.with_name(path.stem + "_failures.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        self._rows = open(path, "ab")  # noqa: SIM115
        self._failures = open(self.failures_path, "ab")  # noqa: SIM115

    @staticmethod
    def done(path: Path) -> set[str]:
        """The episodes of the rows an output file holds already."""
        if not path.exists():
            return set()
        return {
            episode_id(orjson.loads(line))
            for line in path.read_bytes().splitlines()
            if line.strip()
        }

    def write(self, row: Mapping[str, Any], failed: bool = False) -> None:
        (self._failures if failed else self._rows).write(orjson.dumps(row) + b"\n")

    def sync(self) -> None:
        for file in (self._rows, self._failures):
            file.flush()
            os.fsync(file.fileno())

    def close(self) -> None:
        self.sync()
        self._rows.close()
        self._failures.close()


class _Interrupted(Exception):
    pass


class GymCollector:
    """Collects rollouts of one rolloutlog run from NeMo Gym agents (module docstring).

    ``agents``: agent server name -> its URL (``http://host:port``). ``transport``: the
    environment participant's (``HttpTransport``/``KafkaTransport``), ``trainer``: the trainer
    client (checkpoints, restores, results), ``restores``: projections of continued rows;
    ``http``: the client ``/run`` is posted with (default: one of its own, no read timeout);
    ``signals``: bind SIGUSR1/SIGTERM while ``run`` runs; ``fork_from``/``fork_checkpoint``:
    the run is a fork of that run's checkpoint (``"latest"``: its newest committed one);
    ``policy_version``: the trainer's, for the restore (``resume_run``).
    """

    def __init__(
        self,
        *,
        run: str,
        agents: Mapping[str, str],
        output: Path,
        transport: _Transport,
        trainer: AsyncTrainerClient,
        restores: Restores,
        participant_id: str = "collector",
        concurrency: int = 16,
        checkpoint_every_s: float | None = None,
        deadline_s: float | None = None,
        partitions: int | None = None,
        signals: bool = True,
        http: httpx.AsyncClient | None = None,
        fork_from: str | None = None,
        fork_checkpoint: int | str = "latest",
        policy_version: int | None = None,
    ) -> None:
        self.run_name = run
        self.agents = dict(agents)
        self.output_path = output
        self.transport = transport
        self.trainer = trainer
        self.restores = restores
        self.env = Environment(transport, run, participant_id)
        self.concurrency = concurrency
        self.checkpoint_every_s = checkpoint_every_s
        self.deadline_s = deadline_s
        self.partitions = partitions
        self.signals = signals
        self.fork_from = fork_from
        self.fork_checkpoint = fork_checkpoint
        self.policy_version = policy_version
        self._owns_http = http is None
        self.http = http or httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        self._unacknowledged: set[str] = set()
        self._scheduler: CheckpointScheduler | None = None

    async def checkpoint(self, trigger: str = "request") -> CheckpointInfo | None:
        """A checkpoint now, while ``run`` runs (as SIGUSR1 takes one); None when one was
        pending already."""
        if self._scheduler is None:
            raise RuntimeError("no collection is running")
        return await self._scheduler.checkpoint_now(trigger)

    async def close(self) -> None:
        if self._owns_http:
            await self.http.aclose()

    async def run(self, rows: list[dict[str, Any]]) -> CollectionReport:
        """Collect every row not in the output yet (resuming the run's latest checkpoint)."""
        report = CollectionReport(rows=len(rows))
        forked = await self._open_run()
        await self.env.register()
        done = _Output.done(self.output_path)
        output = _Output(self.output_path)
        try:
            began = time.perf_counter()
            plan = await resume_run(self.trainer, self.run_name, policy_version=self.policy_version)
            report.resume_s = time.perf_counter() - began
            report.plan = plan
            report.restore_id = plan.restore_id
            pending = self._plan(rows, plan, done, output, report, forked)
            await self._acknowledge(output)
            scheduler = CheckpointScheduler(
                self.trainer,
                self.run_name,
                checkpoint_every_s=self.checkpoint_every_s,
                deadline_s=self.deadline_s,
                controller_epoch=plan.controller_epoch,
                on_checkpoint=lambda info: report.checkpoints.append(info.checkpoint_id),
            )
            self._scheduler = scheduler
            async with scheduler:
                if plan.checkpoint_id is None:  # a crash from now on has a checkpoint to restore
                    await scheduler.checkpoint_now("start")
                if self.signals:
                    scheduler.install_signal_handlers()
                await self._dispatch(pending, plan, output, report, scheduler)
            await self._acknowledge(output)
        finally:
            self._scheduler = None
            output.close()
        return report

    async def _open_run(self) -> bool:
        """Create the run, or fork it (a no-op once it exists); whether it is a fork."""
        try:
            if self.fork_from is None:
                await self.trainer.create_run(self.run_name, partitions=self.partitions)
                return False
            await self.trainer.fork_run(self.run_name, self.fork_from, self.fork_checkpoint)
            return True
        except RunExists:  # forked before ("latest" may have moved on since): it must be the fork
            origin = (await self.trainer.get_run(self.run_name)).get("forked_from")
            if self.fork_from is not None and (origin or {}).get("run") != self.fork_from:
                raise
            return origin is not None

    def _plan(
        self,
        rows: list[dict[str, Any]],
        plan: ResumePlan,
        done: set[str],
        output: _Output,
        report: CollectionReport,
        forked: bool = False,
    ) -> list[_Rollout]:
        by_episode = {episode_id(row): row for row in rows}
        recovered: set[str] = set()
        for result in plan.results:  # finished, reply lost: the kept result is the rollout row
            if result.episode in by_episode and result.episode not in done:
                output.write(result.result, failed=result.reward is None)
                recovered.add(result.episode)
                done.add(result.episode)
                report.recovered += 1
            self._unacknowledged.add(result.episode)
        dispatch = {d.episode: d for d in plan.dispatch}
        pending: list[_Rollout] = []
        for episode, row in by_episode.items():
            if episode in done:
                report.already_done += episode not in recovered
                continue
            entry = dispatch.get(episode)
            if entry is None and forked:  # a fork holds only what its source handed it
                report.not_forked += 1
            elif entry is None:
                pending.append(_Rollout(row, episode, episode))
            else:
                pending.append(_Rollout(row, episode, entry.capture_key, entry.action))
        pending.sort(key=lambda r: r.action == "fresh")  # replacement attempts first
        return pending

    async def _dispatch(
        self,
        pending: list[_Rollout],
        plan: ResumePlan,
        output: _Output,
        report: CollectionReport,
        scheduler: CheckpointScheduler,
    ) -> None:
        queue: asyncio.Queue[_Rollout] = asyncio.Queue()
        for rollout in pending:
            queue.put_nowait(rollout)
        stop = asyncio.Event()

        async def worker() -> None:
            while not stop.is_set() and not queue.empty():
                rollout = queue.get_nowait()
                try:
                    await self._collect(rollout, plan.restore_id, output, report)
                except _Interrupted as e:
                    report.interrupted.append(f"{rollout.capture_key}: {e}")
                    stop.set()

        async def acknowledger() -> None:
            while True:
                await asyncio.sleep(1.0)
                await self._acknowledge(output)

        async def stopper() -> None:
            await scheduler.wait_for_stop()
            report.stopped = True
            stop.set()

        workers = [asyncio.create_task(worker()) for _ in range(self.concurrency)]
        helpers = [asyncio.create_task(acknowledger()), asyncio.create_task(stopper())]
        all_done: asyncio.Future[Any] = asyncio.gather(*workers, return_exceptions=True)
        stopping: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([all_done, stopping], return_when=asyncio.FIRST_COMPLETED)
            if report.stopped:  # SIGTERM: its checkpoint holds the rows in flight
                all_done.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await all_done  # after an interruption: the rows in flight end
            for worker_task in workers:
                if not worker_task.cancelled() and worker_task.exception() is not None:
                    raise worker_task.exception()  # type: ignore[misc]
        finally:  # also when the collection itself is cancelled: nothing outlives it
            for task in (*workers, *helpers, stopping):
                task.cancel()
            await asyncio.gather(*workers, *helpers, stopping, return_exceptions=True)

    async def _collect(
        self,
        rollout: _Rollout,
        restore_id: int | None,
        output: _Output,
        report: CollectionReport,
    ) -> None:
        context = RolloutContext.of(rollout.capture_key)
        reply: dict[str, Any] | None = None
        episode: EnvironmentEpisode | None = None
        if rollout.action == "continue" and restore_id is not None:
            projection = await self.restores.fetch(self.run_name, rollout.episode, restore_id)
            resumed = self.env.resume(projection, rollout.row)
            episode = resumed.episode
            if resumed.stage == "return" and isinstance(resumed.state, Mapping):
                reply = dict(resumed.state["reply"])
            report.continued += 1
        else:
            if rollout.action == "restart":
                report.restarted += 1
            episode = await self.env.start_episode(context, rollout.row)
        if reply is None:
            await episode.step_started("invoke_agent")
            answer = await self._post_run(rollout, context, restore_id)
            if isinstance(answer, str):  # refused by the agent: a failure row, episode over
                failure = {
                    **self._indices(rollout.row),
                    FAILURE_CLASS: "refused",
                    FAILURE_REASON: answer,
                }
                await episode.finish(None, failure)
                output.write(failure, failed=True)
                report.failed += 1
                self._unacknowledged.add(rollout.episode)
                return
            reply = answer
            await episode.boundary("invoke_agent", {"reply": reply}, next="return")
        row = {**reply, **self._indices(rollout.row)}
        await episode.finish(float(reply["reward"]), row)
        output.write(row)
        report.written += 1
        self._unacknowledged.add(rollout.episode)

    @staticmethod
    def _indices(row: Mapping[str, Any]) -> dict[str, Any]:
        return {key: row[key] for key in (TASK_INDEX, ROLLOUT_INDEX, AGENT_REF)}

    async def _post_run(
        self, rollout: _Rollout, context: RolloutContext, restore_id: int | None
    ) -> dict[str, Any] | str:
        """The agent's ``/run`` reply, or why it refused the row (a 4xx)."""
        name = rollout.row[AGENT_REF]["name"]
        url = self.agents.get(name)
        if url is None:
            raise ValueError(f"no URL for agent {name!r}")
        restore = restore_id if rollout.action == "continue" else None
        headers = rollout_headers(context, restore)
        cookies = rollout_cookies(context, restore)
        headers["cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
        headers["content-type"] = "application/json"
        try:
            response = await self.http.post(
                url + "/run", content=orjson.dumps(rollout.row), headers=headers
            )
        except httpx.HTTPError as e:
            raise _Interrupted(repr(e)) from e
        if response.status_code >= 500:
            raise _Interrupted(f"{response.status_code}: {response.text[:300]}")
        if response.status_code >= 400:
            return f"{response.status_code}: {response.text[:2000]}"
        reply: dict[str, Any] = orjson.loads(response.content)
        return reply

    async def _acknowledge(self, output: _Output) -> None:
        """Acknowledge the rows written since the last call, once they are on disk."""
        if not self._unacknowledged:
            return
        held, self._unacknowledged = self._unacknowledged, set()
        output.sync()
        try:
            await self.trainer.ack_results(self.run_name, held)
        except BaseException:
            self._unacknowledged |= held
            raise


def summary(report: CollectionReport) -> str:
    """One line for the command line."""
    counts = {
        "rows": report.rows,
        "written": report.written,
        "already done": report.already_done,
        "recovered": report.recovered,
        "continued": report.continued,
        "restarted": report.restarted,
        "failed": report.failed,
    }
    if report.not_forked:
        counts["not forked"] = report.not_forked
    parts = [f"{name} {count}" for name, count in counts.items()]
    if report.checkpoints:
        parts.append(f"checkpoints {report.checkpoints}")
    return ", ".join(parts)
