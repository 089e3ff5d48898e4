"""Resources servers and agents: the two kinds that keep sessions."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal

import orjson

from rolloutlog.errors import RolloutlogError
from rolloutlog.log import DELTA_KEY, Opaque, Position, state_delta
from rolloutlog.participants._environment import VERIFY_HEADER
from rolloutlog.participants._participant import (
    Participant,
    RolloutContext,
    checked_name,
    opaque,
)
from rolloutlog.participants._restore import Restores
from rolloutlog.participants._transport import Transport

__all__ = ["Agent", "AgentSession", "ExportHook", "Resources", "SessionKey"]

SessionMode = Literal["restart_only", "stateless", "exported", "checkpoint"]
StepMode = Literal["replay", "wait"]
#: The reply header saying a session cannot be captured (it restarts with its episode).
RESTART_HEADER = "x-ng-checkpoint-restart"
#: (capture key, session id)
SessionKey = tuple[str, str]
#: A ``checkpoint`` session's change mark (its state is exported at checkpoints instead).
_CHANGED = Opaque(b"{}")
_DROPPED = object()
#: Exports the states of many sessions at once (sandboxes may snapshot concurrently); a session
#: left out of the answer is dropped.
ExportHook = Callable[[Sequence[SessionKey]], Awaitable[Mapping[SessionKey, Any]]]


class Resources(Participant):
    """A resources (tool) server; its checkpoint mode is declared in code.

    Mode ``checkpoint`` (export-on-checkpoint, for state outside the process such as a sandbox):
    ``record_state`` before each reply writes only a small change mark; the state is exported
    when a checkpoint asks for it (``serve_exports``: the service names this server's sessions
    open at the checkpoint's markers, ``export_hook`` snapshots them, each export is appended for
    that checkpoint), and ``restored_state`` gives the export on the replacement attempt. The
    checkpoint waits for the exports like an open wait step, until its deadline (then those
    episodes restart). The batch export hook may leave sessions out of its answer: those are
    dropped (not exported; under ``checkpoint`` their episodes restart at the deadline).

    - ``restart_only`` (default, fails closed): a live session restarts its episode;
    - ``stateless``: nothing to restore;
    - ``exported``: ``record_state`` before each reply (or ``export`` through the batch hook for
      state outside the process), and ``restored_state`` on the replacement attempt.

    ``verify`` (``x-ng-checkpoint-verify``) defaults to ``wait``: verify in flight at a checkpoint
    is waited for, never run twice; declare ``replay`` for a verify that may run again.
    """

    kind = "resources"

    def __init__(
        self,
        transport: Transport,
        run: str,
        participant_id: str,
        *,
        mode: SessionMode = "restart_only",
        verify: StepMode = "wait",
        export_hook: ExportHook | None = None,
    ) -> None:
        super().__init__(transport, run, participant_id)
        if mode not in ("restart_only", "stateless", "exported", "checkpoint"):
            raise ValueError(f"unknown resources mode {mode!r}")
        if verify not in ("replay", "wait"):
            raise ValueError(f"unknown verify mode {verify!r}")
        self.mode: SessionMode = mode
        self.verify: StepMode = verify
        self.export_hook = export_hook
        #: Sessions whose state the export hook gave a checkpoint (counted before they are
        #: appended: a checkpoint can commit before the append's acknowledgement arrives).
        self.exports = 0
        self._locks: dict[SessionKey, asyncio.Lock] = {}

    def session_id(self, context: RolloutContext) -> str:
        """The id of this server's session of ``context``'s episode (every attempt's)."""
        return f"{self.id}:{context.episode}"

    def session_lock(self, key: str | RolloutContext, session_id: str) -> asyncio.Lock:
        """The lock ``export`` holds while it snapshots a session and appends the export. Under
        ``checkpoint``, hold it around each change of the session's outside state and its
        ``record_state``: the change mark and the export then land in the log in the order of the
        changes, so an export never misses a change whose mark precedes it."""
        name = (RolloutContext.of(key).capture_key, session_id)
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    @property
    def headers(self) -> dict[str, str]:
        """Headers for ``/seed_session`` replies: the verify mode, and the restart flag."""
        headers: dict[str, str] = {VERIFY_HEADER: self.verify}
        if self.mode == "restart_only":
            headers[RESTART_HEADER] = "1"
        return headers

    async def open_session(
        self, key: str | RolloutContext, session_id: str, state: Any = None
    ) -> Position:
        """``session.started`` (on ``/seed_session``, before replying), and the initial state."""
        context = RolloutContext.of(key)
        data = {"session_id": checked_name("session id", session_id), "mode": self.mode}
        data["verify"] = self.verify
        position = await self.emit("session.started", context, data)
        if state is not None:
            return await self.record_state(context, session_id, state) or position
        return position

    async def record_state(
        self, key: str | RolloutContext, session_id: str, state: Any
    ) -> Position | None:
        """``session.state`` before a reply leaves: the state on ``exported`` servers, a change
        mark without it on ``checkpoint`` servers (the state is exported at checkpoints); the
        others return None without writing."""
        if self.mode == "checkpoint":
            state = _CHANGED
        elif self.mode != "exported":
            return None
        data = {"session_id": session_id, "state": opaque(state), "checkpoint_id": None}
        return await self.emit("session.state", RolloutContext.of(key), data)

    async def end_session(self, key: str | RolloutContext, session_id: str) -> Position:
        """``session.ended`` (on ``/close_session``)."""
        self._locks.pop((RolloutContext.of(key).capture_key, session_id), None)
        return await self.emit("session.ended", RolloutContext.of(key), {"session_id": session_id})

    async def export(
        self, sessions: Sequence[SessionKey], *, checkpoint_id: int | None = None
    ) -> list[Position | None]:
        """Export many sessions' outside state through ``export_hook`` (one call) and record
        each as ``session.state`` (for ``checkpoint_id``, when a checkpoint asked), concurrently
        (one coalesced request). A session the hook leaves out is dropped: None, nothing written."""
        if self.export_hook is None:
            raise RuntimeError("this resources server has no export hook")
        if checkpoint_id is None and self.mode != "exported":
            return [None] * len(sessions)
        async with contextlib.AsyncExitStack() as held:
            for key, sid in sorted(set(sessions)):  # one order: no deadlock between exports
                await held.enter_async_context(self.session_lock(key, sid))
            states = await self.export_hook(sessions)
            if checkpoint_id is not None:  # given to the checkpoint once the hook returned
                self.exports += sum(1 for s in set(sessions) if s in states)

            async def one(key: str, sid: str) -> Position | None:
                state = states.get((key, sid), _DROPPED)
                if state is _DROPPED:
                    return None
                data = {"session_id": sid, "state": opaque(state), "checkpoint_id": checkpoint_id}
                return await self.emit("session.state", RolloutContext.of(key), data)

            return list(await asyncio.gather(*(one(key, sid) for key, sid in sessions)))

    async def serve_exports(self, restores: Restores, *, poll_s: float = 20.0) -> None:
        """Export this server's sessions whenever a checkpoint asks, until cancelled (run it as a
        task beside the server). Each reply of ``Restores.pending_exports`` (a long poll) names
        a pending checkpoint and the sessions it waits for; each is exported once. Failures to
        reach the service are retried after a pause (the checkpoint's deadline bounds the wait)."""
        done: set[tuple[int, str, str]] = set()
        while True:
            try:
                pending = await restores.pending_exports(self.run, self.id, wait_s=poll_s)
            except RolloutlogError as e:
                if not e.retriable:
                    raise
                await asyncio.sleep(1.0)
                continue
            if pending is None:
                continue
            checkpoint_id = int(pending["checkpoint_id"])
            done = {d for d in done if d[0] >= checkpoint_id}  # older checkpoints ended
            fresh = [
                (str(s["capture_key"]), str(s["session_id"]))
                for s in pending["sessions"]
                if (checkpoint_id, s["capture_key"], s["session_id"]) not in done
            ]
            if not fresh:  # exported already, not yet applied by the service: ask again soon
                await asyncio.sleep(0.1)
                continue
            await self.export(fresh, checkpoint_id=checkpoint_id)
            done.update((checkpoint_id, key, sid) for key, sid in fresh)

    def restored_state(self, projection: Mapping[str, Any], session_id: str) -> Any:
        """The state a replacement attempt restores for ``session_id`` (None when none)."""
        session = projection.get("sessions", {}).get(session_id)
        return None if session is None else session.get("state")

    def restored_sessions(self, projection: Mapping[str, Any]) -> dict[str, Any]:
        """Every session of this server in a projection, with its state."""
        return {
            sid: s.get("state")
            for sid, s in projection.get("sessions", {}).items()
            if s.get("participant") == self.id
        }


class AgentSession:
    """One agent session; snapshots are lazy: a boundary only when the state changed.

    With ``Agent(deltas=True)`` (the default) a JSON-object state is written whole once, then each
    boundary carries only what changed since the previous one (keys set, new list items, keys
    removed: ``rolloutlog.core._deltas``), which the fold composes; a list's items already written
    must not change in place. Other states are written whole each time.
    """

    def __init__(
        self, agent: Agent, context: RolloutContext, session_id: str, step: int = 0
    ) -> None:
        self.agent = agent
        self.context = RolloutContext(context.episode, context.attempt)
        self.session_id = session_id
        self.step = step
        self.snapshots = 0
        self.skipped = 0
        #: Bytes of the states this session wrote (whole or delta).
        self.state_bytes = 0
        self._last: bytes | memoryview | None = None
        #: The last state written, as a copy that the caller's later changes leave alone.
        self._state: dict[str, Any] | None = None

    def _payload(self, state: Any) -> Opaque | None:
        """The state to write (whole, or a delta), or None when nothing changed."""
        previous = self._state
        if self.agent.deltas and previous is not None and isinstance(state, Mapping):
            delta = state_delta(previous, state)
            return Opaque(orjson.dumps({DELTA_KEY: delta})) if delta else None
        payload = opaque(state)
        return None if payload.raw == self._last else payload

    async def _snapshot(self, stage: str, next_stage: str, state: Any) -> Position | None:
        if not self.agent.hooks:
            return None
        payload = self._payload(state)
        if payload is None:
            self.skipped += 1
            return None
        data = {"owner": self.session_id, "stage": stage, "next": next_stage, "state": payload}
        position = await self.agent.emit("step.boundary", self.context, data, step=self.step)
        self._remember(state, payload)
        self.step += 1
        self.snapshots += 1
        self.state_bytes += len(payload.raw)
        return position

    def _remember(self, state: Any, payload: Opaque | None) -> None:
        if isinstance(state, Mapping):
            # lists copied (the caller may append to them), items shared: O(keys), no encoding
            self._state = {k: list(v) if type(v) is list else v for k, v in state.items()}
            self._last = None
        else:
            self._state = None
            self._last = payload.raw if payload is not None else opaque(state).raw

    async def before_model_call(self, state: Any) -> Position | None:
        """A boundary before calling the policy (None when nothing changed since the last one)."""
        return await self._snapshot("model_call", "model_call", state)

    async def after_tool_round(self, state: Any) -> Position | None:
        """A boundary after a round of tool calls (None when nothing changed)."""
        return await self._snapshot("tool_round", "model_call", state)

    async def close(self) -> Position:
        """``session.ended``."""
        data = {"session_id": self.session_id}
        return await self.agent.emit("session.ended", self.context, data)


class Agent(Participant):
    """An agent: sessions whose loop state is snapshotted at boundaries (owner = session id).

    ``hooks=False`` declares an agent that cannot snapshot its loop: its sessions are
    ``restart_only`` (their episodes restart from scratch, with that reason) and its boundaries
    are no-ops. ``deltas=False`` writes whole states at every boundary.
    """

    kind = "agent"

    def __init__(
        self,
        transport: Transport,
        run: str,
        participant_id: str,
        *,
        hooks: bool = True,
        deltas: bool = True,
    ) -> None:
        super().__init__(transport, run, participant_id)
        self.hooks = hooks
        self.deltas = deltas

    async def open_session(self, key: str | RolloutContext, session_id: str) -> AgentSession:
        """``session.started``: mode ``exported`` (the state lives in the session's boundaries),
        or ``restart_only`` for an agent without hooks."""
        context = RolloutContext.of(key)
        sid = checked_name("session id", session_id)
        mode = "exported" if self.hooks else "restart_only"
        data = {"session_id": sid, "mode": mode, "verify": "replay"}
        await self.emit("session.started", context, data)
        return AgentSession(self, context, session_id)

    def resume(
        self, projection: Mapping[str, Any], session_id: str
    ) -> tuple[AgentSession, Any, str | None]:
        """The replacement attempt's session, its last snapshot's state (deltas composed) and the
        stage to run next (``model_call``), or (session, None, None) when it had no snapshot."""
        context = RolloutContext(str(projection["episode"]), int(projection["attempt"]))
        boundary = projection.get("boundaries", {}).get(session_id)
        if boundary is None:
            return AgentSession(self, context, session_id), None, None
        session = AgentSession(self, context, session_id, (boundary.get("step") or 0) + 1)
        state = boundary.get("state")
        if isinstance(state, Opaque):
            state = orjson.loads(state.raw)
        session._remember(state, None)
        return session, state, boundary.get("next")
