"""Resume a run after a crash: take over, restore the latest checkpoint, say what to dispatch."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from rolloutlog._telemetry import traced
from rolloutlog.errors import RolloutlogError, UnknownCheckpoint
from rolloutlog.trainer._async_client import AsyncTrainerClient
from rolloutlog.trainer._client import TrainerClient
from rolloutlog.trainer._types import EpisodeResult, RestoreEpisode, RestoreInfo

__all__ = ["Dispatch", "ResumePlan", "resume_run", "resume_run_sync"]


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A rollout to dispatch again: under ``capture_key`` as attempt ``attempt``.

    ``continue``: the participants pick up its projection; ``restart``: it starts over from its
    task (``reason`` says why it could not continue).
    """

    episode: str
    attempt: int
    capture_key: str
    action: str
    previous_attempt: int
    reason: str | None = None


@dataclass(frozen=True)
class ResumePlan:
    run: str
    controller_epoch: int
    #: None when the run had no committed checkpoint (nothing to restore: start fresh).
    checkpoint_id: int | None
    restore_id: int | None
    dispatch: tuple[Dispatch, ...]
    #: Episodes the trainer said it holds results of: retired, not dispatched.
    excluded: tuple[str, ...]
    #: Episodes the checkpoint reports finished (their results were delivered before the cut).
    finished: tuple[str, ...]
    restore: RestoreInfo | None = None
    #: Finished results the trainer has not acknowledged (its crash may have kept their replies
    #: from it): none of them is dispatched again. Acknowledge them (``ack_results``) once
    #: they are safely held, or the next ``resume_run`` returns them again.
    results: tuple[EpisodeResult, ...] = ()

    @property
    def continued(self) -> tuple[Dispatch, ...]:
        return tuple(d for d in self.dispatch if d.action == "continue")

    @property
    def restarted(self) -> tuple[Dispatch, ...]:
        return tuple(d for d in self.dispatch if d.action == "restart")


def _plan(
    run: str,
    epoch: int,
    restore: RestoreInfo,
    entries: Iterable[RestoreEpisode],
    finished: Iterable[str],
    results: Iterable[EpisodeResult],
) -> ResumePlan:
    dispatch: list[Dispatch] = []
    excluded: list[str] = []
    for entry in entries:
        if entry.action == "excluded":
            excluded.append(entry.episode)
        else:
            dispatch.append(
                Dispatch(
                    entry.episode,
                    entry.attempt,
                    entry.capture_key,
                    entry.action,
                    entry.previous_attempt,
                    entry.reason,
                )
            )
    return ResumePlan(
        run,
        epoch,
        restore.checkpoint_id,
        restore.restore_id,
        tuple(dispatch),
        tuple(excluded),
        tuple(finished),
        restore,
        tuple(results),
    )


#: A restore refused with a retriable error (``unavailable``: the catalog aborted it, say on a
#: PostgreSQL deadlock; ``restore_conflict``) wrote nothing: ``resume_run`` asks again, this
#: many times, waiting 0.2 s doubling in between.
RESTORE_TRIES = 6

#: One step of ``_resume``: a call of the client (its result, or the error it raised, is sent
#: back), or seconds to sleep.
_Step = Callable[[], Any] | float


def _retry_delay_s(error: RolloutlogError, tries: int) -> float | None:
    """Seconds to wait before asking again after ``tries`` refusals, or None to give up."""
    if not error.retriable or tries >= RESTORE_TRIES:
        return None
    delay: float = 0.2 * 2 ** (tries - 1)
    return delay


def _resume(
    client: AsyncTrainerClient | TrainerClient,
    run: str,
    exclude: Iterable[str],
    policy_version: int | None,
    max_policy_lag: int | None,
) -> Generator[_Step, Any, ResumePlan]:
    """``resume_run``'s steps, once for both clients (``_drive`` and ``_drive_sync`` run them)."""
    excluded = list(exclude)
    epoch = yield lambda: client.take_over(run)
    unacknowledged = lambda: client.results(run, unacknowledged=True)  # noqa: E731
    tries = 0
    while True:
        try:
            restore: RestoreInfo = yield lambda: client.restore(
                run,
                checkpoint_id="latest",
                exclude=excluded,
                policy_version=policy_version,
                max_policy_lag=max_policy_lag,
                controller_epoch=epoch,
                exclude_results=True,
            )
            break
        except UnknownCheckpoint:
            return ResumePlan(run, epoch, None, None, (), (), (), results=(yield unacknowledged))
        except RolloutlogError as e:
            tries += 1
            delay = _retry_delay_s(e, tries)
            if delay is None:
                raise
            yield delay
    entries = yield lambda: client.restore_episodes(run, restore.restore_id)
    manifest = yield lambda: client.manifest(run, restore.checkpoint_id)
    finished = [item["episode"] for item in manifest if item["action"] == "finished"]
    # Read after the restore: it excluded every held result's episode, so these are exactly the
    # results nothing will dispatch again.
    results = yield unacknowledged
    return _plan(run, epoch, restore, entries, finished, results)


async def _drive(steps: Generator[_Step, Any, ResumePlan]) -> ResumePlan:
    value: Any = None
    error: RolloutlogError | None = None
    while True:
        try:
            step = steps.throw(error) if error is not None else steps.send(value)
        except StopIteration as done:
            plan: ResumePlan = done.value
            return plan
        value, error = None, None
        if isinstance(step, float):
            await asyncio.sleep(step)
            continue
        try:
            value = step()
            if inspect.isawaitable(value):
                value = await value
            elif isinstance(value, AsyncIterator):
                value = [item async for item in value]
        except RolloutlogError as e:
            error = e


def _drive_sync(steps: Generator[_Step, Any, ResumePlan]) -> ResumePlan:
    value: Any = None
    error: RolloutlogError | None = None
    while True:
        try:
            step = steps.throw(error) if error is not None else steps.send(value)
        except StopIteration as done:
            plan: ResumePlan = done.value
            return plan
        value, error = None, None
        if isinstance(step, float):
            time.sleep(step)
            continue
        try:
            value = step()
            if isinstance(value, Iterator):
                value = list(value)
        except RolloutlogError as e:
            error = e


@traced("rolloutlog.resume_run")
async def resume_run(
    client: AsyncTrainerClient,
    run: str,
    *,
    exclude: Iterable[str] = (),
    policy_version: int | None = None,
    max_policy_lag: int | None = None,
) -> ResumePlan:
    """Take over the run's controller and restore its latest committed checkpoint.

    Returns which rollouts to dispatch again, under which capture keys, and the finished results
    the trainer has not acknowledged (``results``): their episodes are excluded from the restore
    (``exclude_results``), so each rollout is either dispatched again or returned as a result,
    never both, never neither. A run without a committed checkpoint yields an empty plan (the
    controller is still taken over) with those results. A retriable refusal of the restore
    (nothing was written) is asked again, up to ``RESTORE_TRIES`` times.
    """
    return await _drive(_resume(client, run, exclude, policy_version, max_policy_lag))


@traced("rolloutlog.resume_run")
@traced("rolloutlog.resume_run")
def resume_run_sync(
    client: TrainerClient,
    run: str,
    *,
    exclude: Iterable[str] = (),
    policy_version: int | None = None,
    max_policy_lag: int | None = None,
) -> ResumePlan:
    """``resume_run`` for the blocking client."""
    return _drive_sync(_resume(client, run, exclude, policy_version, max_policy_lag))
