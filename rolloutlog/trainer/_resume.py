"""Resume a run after a crash: take over, restore the latest checkpoint, say what to dispatch."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass

from rolloutlog._telemetry import traced
from rolloutlog.errors import RolloutlogError, UnknownCheckpoint
from rolloutlog.trainer._client import AsyncTrainerClient, TrainerClient
from rolloutlog.trainer._types import RestoreEpisode, RestoreInfo

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
    )


#: A restore refused with a retriable error (``unavailable``: the catalog aborted it, say on a
#: PostgreSQL deadlock; ``restore_conflict``) wrote nothing: ``resume_run`` asks again, this
#: many times, waiting 0.2 s doubling in between.
RESTORE_TRIES = 6


def _retry_delay_s(error: RolloutlogError, tries: int) -> float | None:
    """Seconds to wait before asking again after ``tries`` refusals, or None to give up."""
    if not error.retriable or tries >= RESTORE_TRIES:
        return None
    delay: float = 0.2 * 2 ** (tries - 1)
    return delay


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

    Returns which rollouts to dispatch again, under which capture keys. A run without a committed
    checkpoint yields an empty plan (the controller is still taken over). A retriable refusal of
    the restore (nothing was written) is asked again, up to ``RESTORE_TRIES`` times.
    """
    epoch = await client.take_over(run)
    tries = 0
    while True:
        try:
            restore = await client.restore(
                run,
                checkpoint_id="latest",
                exclude=exclude,
                policy_version=policy_version,
                max_policy_lag=max_policy_lag,
                controller_epoch=epoch,
            )
            break
        except UnknownCheckpoint:
            return ResumePlan(run, epoch, None, None, (), (), ())
        except RolloutlogError as e:
            tries += 1
            delay = _retry_delay_s(e, tries)
            if delay is None:
                raise
            await asyncio.sleep(delay)
    entries = [entry async for entry in client.restore_episodes(run, restore.restore_id)]
    finished = [
        item["episode"]
        async for item in client.manifest(run, restore.checkpoint_id)
        if item["action"] == "finished"
    ]
    return _plan(run, epoch, restore, entries, finished)


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
    epoch = client.take_over(run)
    tries = 0
    while True:
        try:
            restore = client.restore(
                run,
                checkpoint_id="latest",
                exclude=exclude,
                policy_version=policy_version,
                max_policy_lag=max_policy_lag,
                controller_epoch=epoch,
            )
            break
        except UnknownCheckpoint:
            return ResumePlan(run, epoch, None, None, (), (), ())
        except RolloutlogError as e:
            tries += 1
            delay = _retry_delay_s(e, tries)
            if delay is None:
                raise
            time.sleep(delay)
    entries = list(client.restore_episodes(run, restore.restore_id))
    finished = [
        item["episode"]
        for item in client.manifest(run, restore.checkpoint_id)
        if item["action"] == "finished"
    ]
    return _plan(run, epoch, restore, entries, finished)
