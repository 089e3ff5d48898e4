"""The environment: episodes with the stages of docs/design.md §7, and resuming a replacement attempt."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rolloutlog.errors import InvalidRequest
from rolloutlog.log import Position
from rolloutlog.participants._participant import (
    Participant,
    RolloutContext,
    opaque,
    task_digest,
)

__all__ = ["STAGES", "Environment", "EnvironmentEpisode", "Resumed"]

StepMode = Literal["replay", "wait"]
OWNER = "environment"
#: The stages of a single-turn episode, in order, with their step modes (``verify`` takes the
#: mode the resources server reports).
STAGES: tuple[str, ...] = ("seed", "invoke_agent", "close_agent", "verify", "return")
_MODES: dict[str, StepMode] = {
    "seed": "replay",
    "invoke_agent": "replay",
    "close_agent": "wait",
    "return": "replay",
}
#: The response header a resources server's ``/seed_session`` reply names its verify mode in.
VERIFY_HEADER = "x-ng-checkpoint-verify"


_NEXT: dict[str, str | None] = {
    stage: after for stage, after in zip(STAGES, (*STAGES[1:], None), strict=True)
}


def next_stage(stage: str) -> str | None:
    return _NEXT.get(stage)


class EnvironmentEpisode:
    """One attempt of one episode, as the environment drives it."""

    def __init__(self, environment: Environment, context: RolloutContext, step: int = 0) -> None:
        self.environment = environment
        self.context = RolloutContext(context.episode, context.attempt)
        self.step = step
        #: The verify mode the resources server reported (``wait`` until one is seen: an
        #: undeclared server's verify never runs twice).
        self.verify_mode: StepMode = "wait"

    @property
    def capture_key(self) -> str:
        return self.context.capture_key

    def set_verify_mode(self, value: str | Mapping[str, str] | None) -> StepMode:
        """Take the verify mode from the resources server's ``x-ng-checkpoint-verify`` header
        (a header value or a headers mapping); a missing or unknown value means ``wait``, which
        never runs verify twice."""
        if value is not None and not isinstance(value, str):
            value = value.get(VERIFY_HEADER)
        self.verify_mode = "replay" if value == "replay" else "wait"
        return self.verify_mode

    def mode_of(self, stage: str) -> StepMode:
        return self.verify_mode if stage == "verify" else _MODES.get(stage, "wait")

    async def step_started(self, stage: str, mode: StepMode | None = None) -> Position:
        """``step.started`` of a stage (its §7 mode unless given)."""
        data = {"owner": OWNER, "stage": stage, "mode": mode or self.mode_of(stage)}
        return await self.environment.emit("step.started", self.context, data, step=self.step)

    async def boundary(self, stage: str, state: Any = None, next: str | None = None) -> Position:
        """``step.boundary`` after ``stage``: ``state`` is what continuing needs (session handles,
        the agent's response…); ``next`` defaults to the stage after it."""
        data = {
            "owner": OWNER,
            "stage": stage,
            "next": next if next is not None else next_stage(stage),
            "state": opaque(state),
        }
        position = await self.environment.emit("step.boundary", self.context, data, step=self.step)
        self.step += 1
        return position

    async def finish(self, reward: float | None, result: Any = None) -> Position:
        """``episode.finished``: await it before replying to the trainer."""
        data = {"reward": reward, "result": None if result is None else opaque(result)}
        return await self.environment.emit("episode.finished", self.context, data, step=self.step)


@dataclass(frozen=True, slots=True)
class Resumed:
    """Where a replacement attempt continues: the stage to run next and the last boundary's
    state (None when the episode starts from ``seed``)."""

    episode: EnvironmentEpisode
    stage: str
    state: Any
    task: Any


class Environment(Participant):
    """An environment server: starts episodes, commits each stage, finishes them."""

    kind = "environment"

    async def start_episode(
        self,
        key: str | RolloutContext,
        task: Any,
        *,
        deadline_s: float | None = None,
    ) -> EnvironmentEpisode:
        """``episode.started`` with the task and its canonical digest."""
        context = RolloutContext.of(key)
        payload = opaque(task)
        data = {"task": payload, "task_digest": task_digest(payload), "deadline_s": deadline_s}
        await self.emit("episode.started", context, data, step=0)
        return EnvironmentEpisode(self, context)

    def resume(self, projection: Mapping[str, Any], task: Any = None) -> Resumed:
        """A replacement attempt from its projection (``GET …/projection?restore=ID``).

        Checks the projection's task digest (and, when ``task`` is given, that it is the task
        the trainer dispatched); raises ``InvalidRequest`` when either does not match.
        """
        recorded = projection.get("task")
        digest = projection.get("task_digest")
        if recorded is None or digest is None or task_digest(recorded) != digest:
            raise InvalidRequest(
                f"episode {projection.get('episode')!r}: the projection's task digest does not "
                "match its task",
                episode=projection.get("episode"),
            )
        if task is not None and task_digest(task) != digest:
            raise InvalidRequest(
                f"episode {projection.get('episode')!r}: the dispatched task is not the "
                "checkpointed one",
                episode=projection.get("episode"),
            )
        context = RolloutContext(str(projection["episode"]), int(projection["attempt"]))
        boundary = projection.get("boundaries", {}).get(OWNER)
        if boundary is None:
            return Resumed(EnvironmentEpisode(self, context), "seed", None, recorded)
        step = (boundary.get("step") or 0) + 1
        stage = boundary.get("next") or next_stage(boundary["stage"]) or "return"
        return Resumed(EnvironmentEpisode(self, context, step), stage, boundary["state"], recorded)
