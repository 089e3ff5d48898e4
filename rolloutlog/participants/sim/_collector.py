"""The rollout collector: drives rollouts against the environment server(s) and checkpoints and
restores them with ``rolloutlog.trainer``."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import httpx

from rolloutlog.errors import RolloutlogError, RunExists
from rolloutlog.participants.sim._model import expected_reward
from rolloutlog.trainer import AsyncTrainerClient, CheckpointInfo, ResumePlan, resume_run
from rolloutlog.wire import CLIENT_KEEPALIVE_S

__all__ = ["Collector", "CollectorReport", "Rollout"]

_FINAL = ("done", "failed", "lost")
#: How long the collector asks again to acknowledge results while the service is down (the
#: participants' append deadline: both ride through the same restart).
ACK_DEADLINE_S = 120.0


@dataclass
class Rollout:
    """One rollout as the collector tracks it across attempts.

    ``status``: ``pending`` (not dispatched), ``running``, ``interrupted`` (its request failed
    with no reply, a 5xx or a fencing 409: a crash; it waits for a restore), ``done``, ``failed``
    (the environment refused it: another 4xx, in ``error``), or ``lost`` (the checkpoint says it
    finished before the cut but its reply never arrived, and the service returned no result).
    ``recovered``: its reply was lost in a crash and its result came from the service instead.
    ``history``: (capture key, how it was dispatched: ``fresh``, ``continue`` or ``restart``) per
    dispatch.
    """

    episode: str
    task: dict[str, Any]
    capture_key: str
    action: str = "fresh"
    restore_id: int | None = None
    status: str = "pending"
    reward: float | None = None
    reply: dict[str, Any] | None = None
    error: str | None = None
    recovered: bool = False
    history: list[tuple[str, str]] = field(default_factory=list)

    @property
    def expected(self) -> float:
        return expected_reward(self.task)

    @property
    def right(self) -> bool:
        return self.status == "done" and self.reward == self.expected


@dataclass
class CollectorReport:
    rollouts: int
    finished: int
    right: int
    wrong: list[str]
    lost: list[str]
    failed: list[str]
    continued: int
    restarted: int
    checkpoints: list[CheckpointInfo]
    restores: list[ResumePlan]
    elapsed_s: float
    #: Rollouts whose reply a crash lost, finished with the result the service kept.
    recovered: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every rollout finished with its expected reward."""
        return self.finished == self.rollouts == self.right


class Collector:
    """Drives rollouts concurrently (``concurrency`` in flight) against environment servers.

    ::

        collector = gym.collector(concurrency=64)        # or Collector(service_url, run, [env])
        async with collector:
            runner = asyncio.create_task(collector.run(tasks))
            await collector.wait_done(len(tasks) // 3)
            await collector.checkpoint(pause=True)        # quiesced: every dispatched rollout
            gym.kill_participants()                       #   is in the checkpoint
            plan = await collector.restore()              # resume_run, excluding held results
            await gym.start_participants(plan.restore_id)
            collector.redispatch()                        # continue / restart / fresh
            report = await runner

    After a restore, each ``continue`` rollout is dispatched as its replacement attempt (the
    environment resumes it from its projection), each ``restart`` one from its input one
    attempt later, and rollouts the checkpoint never saw as they were. (After a checkpoint
    without ``pause``, dispatch went on: the restore restarts the rollouts begun after its
    markers one attempt later, like any other restart, unless their results are held: those
    are excluded.)
    The collector acknowledges the results it receives (``ack_results``, in batches: before a
    checkpoint or restore and at the end); a restore hands back the finished results whose
    replies a crash lost (``ResumePlan.results``), and those rollouts are done with the kept
    result (``recovered``) instead of being dispatched again. Rewards are checked against
    ``expected_reward(task)``.
    """

    def __init__(
        self,
        service_url: str,
        run: str,
        env_urls: Iterable[str],
        *,
        concurrency: int = 64,
        partitions: int | None = None,
        token: str | None = None,
        on_progress: Callable[[Collector], None] | None = None,
    ) -> None:
        self.run_name = run
        self.env_urls = list(env_urls)
        self.concurrency = concurrency
        self.partitions = partitions
        # Idle connections expire before the service closes them (``wire.CLIENT_KEEPALIVE_S``).
        self._service_http = httpx.AsyncClient(
            timeout=300.0, limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S)
        )
        self.trainer = AsyncTrainerClient(service_url, token=token, client=self._service_http)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(600.0, connect=10.0),
            limits=httpx.Limits(max_connections=concurrency + 16),
        )
        self.on_progress = on_progress
        self.rollouts: dict[str, Rollout] = {}
        self.checkpoints: list[CheckpointInfo] = []
        self.restores: list[ResumePlan] = []
        #: rollouts to dispatch, in order (replacement attempts go first); a rollout is in it
        #: at most once (``_queued``), and is dispatched as it stands when a worker takes it
        self._ready: collections.deque[Rollout] = collections.deque()
        self._queued: set[str] = set()
        #: rollouts dispatched since the latest checkpoint's quiesce (after its markers)
        self._since_checkpoint: set[str] = set()
        #: results received and not yet acknowledged to the service
        self._unacknowledged: set[str] = set()
        self._available = asyncio.Event()
        self._gate = asyncio.Event()
        self._gate.set()
        self._changed = asyncio.Event()
        self._setup = False
        self._next_env = 0
        self._began = time.perf_counter()

    async def __aenter__(self) -> Self:
        await self.setup()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.http.aclose()
        await self.trainer.stop()
        await self._service_http.aclose()

    async def setup(self) -> None:
        """Create the run (if needed) and take over its controller."""
        if self._setup:
            return
        with contextlib.suppress(RunExists):
            await self.trainer.create_run(self.run_name, partitions=self.partitions)
        await self.trainer.take_over(self.run_name)
        self._setup = True

    # -- counts ------------------------------------------------------------------------------

    def counts(self) -> Counter[str]:
        return Counter(r.status for r in self.rollouts.values())

    async def wait_for(
        self, predicate: Callable[[Collector], bool], timeout_s: float = 300
    ) -> None:
        """Wait until ``predicate(self)`` holds (checked whenever a rollout changes)."""
        async with asyncio.timeout(timeout_s):
            while not predicate(self):
                self._changed.clear()
                await self._changed.wait()

    async def wait_done(self, count: int, timeout_s: float = 300) -> None:
        """Wait until ``count`` rollouts are done."""
        await self.wait_for(lambda c: c.counts()["done"] >= count, timeout_s)

    def _touch(self) -> None:
        self._changed.set()
        if self.on_progress is not None:
            self.on_progress(self)

    # -- dispatch ----------------------------------------------------------------------------

    def add(self, tasks: Iterable[Mapping[str, Any]]) -> None:
        for task in tasks:
            episode = str(task["id"])
            rollout = Rollout(episode, dict(task), episode)
            self.rollouts[episode] = rollout
            self._enqueue(rollout)

    def adopt(self, tasks: Iterable[Mapping[str, Any]]) -> None:
        """Take over rollouts already under way elsewhere (a fork's episodes, forked from
        another run's checkpoint): they wait, as interrupted, for ``restore`` to say how each
        goes on in this run."""
        for task in tasks:
            episode = str(task["id"])
            self.rollouts[episode] = Rollout(episode, dict(task), episode, status="interrupted")

    def _enqueue(self, rollout: Rollout, first: bool = False) -> None:
        if rollout.episode in self._queued:
            return
        self._queued.add(rollout.episode)
        if first:
            self._ready.appendleft(rollout)
        else:
            self._ready.append(rollout)
        self._available.set()

    async def run(
        self, tasks: Iterable[Mapping[str, Any]] = (), *, timeout_s: float = 600
    ) -> CollectorReport:
        """Run ``tasks`` (and any added before) until every rollout is done or lost; crashes
        in between leave rollouts ``interrupted`` until ``restore`` and ``redispatch``.
        ``TimeoutError`` after ``timeout_s`` (a rollout interrupted with no restore to follow
        waits for one until then)."""
        await self.setup()
        self.add(tasks)
        workers = [asyncio.create_task(self._worker()) for _ in range(self.concurrency)]
        try:
            await self.wait_for(
                lambda c: all(r.status in _FINAL for r in c.rollouts.values()),
                timeout_s,
            )
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        await self.acknowledge()
        return self.report()

    async def _worker(self) -> None:
        while True:
            if not self._ready:
                self._available.clear()
                await self._available.wait()
                continue
            await self._gate.wait()
            # a waiter woken by resume_dispatch() may run after a pause() that followed it
            if not self._gate.is_set() or not self._ready:
                continue
            # taken only past the gate: a restore may still change a queued rollout's dispatch
            rollout = self._ready.popleft()
            self._queued.discard(rollout.episode)
            if rollout.status == "pending":
                await self._dispatch(rollout)

    async def _dispatch(self, rollout: Rollout) -> None:
        url = self.env_urls[self._next_env % len(self.env_urls)]
        self._next_env += 1
        rollout.status = "running"
        rollout.history.append((rollout.capture_key, rollout.action))
        self._since_checkpoint.add(rollout.episode)
        body = {
            "run": self.run_name,
            "task": rollout.task,
            "capture_key": rollout.capture_key,
            "action": rollout.action,
            "restore_id": rollout.restore_id,
        }
        self._touch()
        try:
            response = await self.http.post(url + "/run", json=body)
        except httpx.HTTPError as e:
            rollout.status, rollout.error = "interrupted", repr(e)
        else:
            if response.status_code == 200:
                rollout.reply = response.json()
                rollout.reward = float(rollout.reply["reward"])
                rollout.status = "done"
                self._unacknowledged.add(rollout.episode)
            else:
                refused = 400 <= response.status_code < 500 and response.status_code != 409
                rollout.status = "failed" if refused else "interrupted"
                rollout.error = f"{response.status_code}: {response.text[:300]}"
        self._touch()

    # -- checkpoints and restores ------------------------------------------------------------

    async def acknowledge(self) -> int:
        """Acknowledge the results received since the last call (the service then never hands
        them back after a restore); how many were new to it."""
        held, self._unacknowledged = self._unacknowledged, set()
        try:
            return await self._ride_through(lambda: self.trainer.ack_results(self.run_name, held))
        except BaseException:
            self._unacknowledged |= held  # acknowledged next time
            raise

    async def _ride_through(self, call: Callable[[], Awaitable[int]]) -> int:
        """``call`` asked again while the service is unreachable or answers a retriable refusal
        (a restart, an upgrade), with jittered doubling pauses, for up to ``ACK_DEADLINE_S``."""
        deadline = time.monotonic() + ACK_DEADLINE_S
        delay = 0.1
        while True:
            try:
                return await call()
            except (httpx.TransportError, RolloutlogError) as e:
                if isinstance(e, RolloutlogError) and not e.retriable:
                    raise
                if time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, 5.0)

    def pause(self) -> None:
        """Dispatch no new rollouts (those in flight go on)."""
        self._gate.clear()

    def resume_dispatch(self) -> None:
        self._gate.set()

    async def quiesce(self, timeout_s: float = 60) -> None:
        """Pause, then wait until every rollout in flight is durably started at its
        environment, so a checkpoint taken now contains every dispatched rollout."""
        self.pause()
        async with asyncio.timeout(timeout_s):
            for url in self.env_urls:
                while True:
                    keys = [r.capture_key for r in self.rollouts.values() if r.status == "running"]
                    response = await self.http.post(url + "/sim/started", json={"keys": keys})
                    response.raise_for_status()
                    if not response.json()["missing"]:
                        break
                    await asyncio.sleep(0.01)

    async def checkpoint(
        self, *, pause: bool = False, deadline_s: float | None = None, wait: bool = True
    ) -> CheckpointInfo:
        """Take a checkpoint. ``pause=True`` quiesces first and leaves dispatch paused (for a
        crash right after); otherwise dispatch goes on."""
        await self.acknowledge()  # before the quiesce: it adds nothing between it and the marker
        await self.quiesce()
        self._since_checkpoint = set()
        try:
            info = await self.trainer.checkpoint(self.run_name, deadline_s=deadline_s, wait=wait)
        finally:
            if not pause:
                self.resume_dispatch()
        self.checkpoints.append(info)
        return info

    async def restore(self, *, timeout_s: float = 60) -> ResumePlan:
        """After a crash: wait until no rollout is in flight, restore the latest checkpoint
        (``resume_run``: take over, restore, excluding the rollouts whose results are held),
        finish the rollouts whose results the service kept for it, and set each interrupted
        rollout's next dispatch. Dispatch stays paused until ``redispatch``."""
        self.pause()
        await self.wait_for(
            lambda c: not any(r.status == "running" for r in c.rollouts.values()), timeout_s
        )
        latest = await self.trainer.get_checkpoint(self.run_name, "latest")
        manifest = {
            item["episode"]: item["action"]
            async for item in self.trainer.manifest(self.run_name, latest.checkpoint_id)
        }
        held = [
            episode
            for episode, action in manifest.items()
            if action != "finished"
            and episode in self.rollouts
            and self.rollouts[episode].status == "done"
        ]
        # Rollouts dispatched after the checkpoint's markers and finished: the restore would
        # restart them (it fences every episode begun after the markers); their results are held.
        held += sorted(
            episode
            for episode in self._since_checkpoint
            if episode not in manifest and self.rollouts[episode].status == "done"
        )
        await self.acknowledge()
        plan = await resume_run(self.trainer, self.run_name, exclude=held)
        self.restores.append(plan)
        for result in plan.results:
            rollout = self.rollouts.get(result.episode)
            if rollout is None:
                continue  # not this collector's: left for its owner to acknowledge
            if rollout.status != "done":
                rollout.reply = {
                    "episode": result.episode,
                    "capture_key": result.capture_key,
                    "reward": result.reward,
                    "result": result.result,
                }
                rollout.reward = result.reward
                rollout.capture_key = result.capture_key
                rollout.status, rollout.recovered, rollout.error = "done", True, None
            self._unacknowledged.add(result.episode)
        await self.acknowledge()
        dispatch = {d.episode: d for d in plan.dispatch}
        for rollout in self.rollouts.values():
            if rollout.status in ("done", "failed"):
                continue
            entry = dispatch.get(rollout.episode)
            if entry is not None:
                rollout.capture_key = entry.capture_key
                rollout.action = entry.action
                rollout.restore_id = plan.restore_id
                rollout.status = "interrupted"
            elif manifest.get(rollout.episode) == "finished":
                rollout.status = "lost"
                rollout.error = "finished before the cut; neither its reply nor its result came"
        self._touch()
        return plan

    def redispatch(self) -> None:
        """Queue every interrupted rollout again (as ``restore`` set it), ahead of those not
        yet dispatched, and resume dispatch."""
        again = [r for r in self.rollouts.values() if r.status == "interrupted"]
        for rollout in reversed(again):
            rollout.status = "pending"
            self._queued.discard(rollout.episode)  # moves to the front if it was queued
            with contextlib.suppress(ValueError):
                self._ready.remove(rollout)
            self._enqueue(rollout, first=True)
        self.resume_dispatch()
        self._touch()

    def report(self) -> CollectorReport:
        rollouts = list(self.rollouts.values())
        done = [r for r in rollouts if r.status == "done"]
        return CollectorReport(
            rollouts=len(rollouts),
            finished=len(done),
            right=sum(r.right for r in done),
            wrong=[r.episode for r in done if not r.right],
            lost=[r.episode for r in rollouts if r.status == "lost"],
            failed=[r.episode for r in rollouts if r.status == "failed"],
            continued=sum(r.action == "continue" for r in done),
            restarted=sum(r.action == "restart" for r in done),
            checkpoints=list(self.checkpoints),
            restores=list(self.restores),
            elapsed_s=time.perf_counter() - self._began,
            recovered=[r.episode for r in rollouts if r.recovered],
        )
