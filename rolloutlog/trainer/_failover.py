"""Several service URLs for one trainer client (docs/api.md, "Several service URLs"): the rules
both clients follow to move to the next URL, kept here once (the clients do the I/O).

- A call moves on after a transport error that proves the request never left (connection
  refused, connect timeout), after any transport error of a read-only call (``GET``), and after
  a refusal that wrote nothing and may succeed elsewhere (``unavailable``, a balancer's 502/504
  for a ``GET``). A write whose request may have been taken (a reset or a timeout after it was
  sent) is not sent again: the error is the caller's, as with one URL.
- A checkpoint request is the exception: it may be sent again after any transport error, since
  the catalog tells whether the first one was taken (``CheckpointAttempt``): one of this
  controller epoch that committed since the call began is the answer; one still pending is
  asked about again (``checkpoint_in_progress`` while its requester lives; superseded, and a new
  one begun, once the requester's lease lapsed: never two); otherwise a new one is requested.
  ``checkpoint_in_progress`` is asked again until the deadline (a dead replica's checkpoint is
  superseded once its lease lapsed).
- Every call is bounded: a checkpoint by its deadline (plus the service's grace), others by
  the client's ``failover_s``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from rolloutlog.errors import RolloutlogError

__all__ = [
    "CHECKPOINT_GRACE_S",
    "CheckpointAttempt",
    "ServiceUrls",
    "movable_error",
    "movable_transport",
]

#: What a checkpoint call adds to its deadline before it gives up moving between URLs: the
#: service waits that long past it for other replicas' parts (``GRACE_S``) and a little more.
CHECKPOINT_GRACE_S = 10.0
#: What one checkpoint request's timeout adds to its deadline (``checkpoint_answer_s``).
CHECKPOINT_ANSWER_GRACE_S = 6.0
#: The server's deadline of a checkpoint request that names none.
DEFAULT_CHECKPOINT_DEADLINE_S = 30.0
#: The pause between two rounds over every URL (doubling up to ``_ROUND_PAUSE_MAX_S``).
_ROUND_PAUSE_S = 0.1
_ROUND_PAUSE_MAX_S = 1.0
#: How often a checkpoint call asks again while another checkpoint is pending.
POLL_S = 0.25


def movable_transport(error: httpx.TransportError, method: str) -> bool:
    """Whether a call may go to the next URL after ``error``: the request never left, or the
    call only reads."""
    if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return True
    return method == "GET"


def movable_error(error: RolloutlogError, method: str) -> bool:
    """Whether a refusal may be answered otherwise by another URL: ``unavailable`` (nothing was
    written), or a balancer's 502/504 for a read."""
    if error.code == "unavailable":
        return True
    return method == "GET" and error.http_status in (502, 503, 504)


class ServiceUrls:
    """The URLs a client moves between, starting where the last call succeeded."""

    def __init__(self, urls: tuple[str, ...]) -> None:
        self.urls = urls
        self._at = 0

    @property
    def current(self) -> str:
        return self.urls[self._at]

    def advance(self) -> bool:
        """Move to the next URL; True when that starts a new round over all of them."""
        self._at = (self._at + 1) % len(self.urls)
        return self._at == 0


class Rounds:
    """When a call moving between URLs should pause, and when it must give up."""

    def __init__(self, budget_s: float) -> None:
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self._pause = _ROUND_PAUSE_S

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def pause_s(self, new_round: bool) -> float:
        """How long to wait before the next try (0 within a round), never past the deadline."""
        if not new_round:
            return 0.0
        pause, self._pause = self._pause, min(_ROUND_PAUSE_MAX_S, self._pause * 2)
        return max(0.0, min(pause, self.deadline - time.monotonic()))


@dataclass
class CheckpointAttempt:
    """One checkpoint call over several URLs: whether a request of it may have been taken, and
    what the catalog's newest checkpoint says about that."""

    controller_epoch: int
    #: The newest checkpoint id this client knows for the run (None: none yet).
    known_id: int | None
    #: The call's wall-clock start (a committed checkpoint requested before it is not its own).
    began_at: float
    #: Set once a request may have been taken (sent, no answer).
    unanswered: bool = False

    @classmethod
    def begin(cls, controller_epoch: int, known_id: int | None) -> CheckpointAttempt:
        return cls(controller_epoch, known_id, time.time())

    def taken(self, newest: Sequence[Mapping[str, Any]], wait: bool) -> Mapping[str, Any] | None:
        """After an unanswered request, given the run's newest checkpoint (a list of at most
        one): the checkpoint that request began once it committed (or, ``wait=False``, while it
        is pending), else None. While it is pending the request is unanswered still: asking
        again answers ``checkpoint_in_progress`` while its requester lives, and supersedes it
        once the requester's lease lapsed (only one of them commits)."""
        for body in newest[:1]:
            verdict = self._verdict(body)
            if verdict == "done" or (verdict == "wait" and not wait):
                self.unanswered = False
                return body
            if verdict == "wait":
                return None
        self.unanswered = False  # not taken, or it failed: ask again
        return None

    def _verdict(self, newest: Mapping[str, Any]) -> str | None:
        """``"wait"`` when the newest checkpoint may be the unanswered request's and is
        pending, ``"done"`` when it is and committed, else None. Only one of this controller
        epoch, newer than the client knows, requested since the call began (the service's
        clock; a few seconds' skew is allowed for)."""
        if int(newest.get("controller_epoch", -1)) != self.controller_epoch:
            return None
        checkpoint_id = int(newest["checkpoint_id"])
        if self.known_id is not None and checkpoint_id <= self.known_id:
            return None
        if float(newest.get("requested_at") or 0.0) < self.began_at - _CLOCK_SKEW_S:
            return None
        status = newest.get("status")
        if status == "pending":
            return "wait"
        return "done" if status == "committed" else None


#: How far the service's clock may be behind the trainer's for ``CheckpointAttempt.adopt``.
_CLOCK_SKEW_S = 5.0


def checkpoint_answer_s(deadline_s: float | None) -> float:
    """How long one checkpoint request may go unanswered: the service answers by its deadline
    plus its grace (5 s); a replica that has not by then is paused or gone (what is left of the
    call's budget asks another whether the checkpoint committed all the same)."""
    return (deadline_s or DEFAULT_CHECKPOINT_DEADLINE_S) + CHECKPOINT_ANSWER_GRACE_S


def checkpoint_budget_s(deadline_s: float | None) -> float:
    """How long a checkpoint call moves between URLs."""
    return (deadline_s or DEFAULT_CHECKPOINT_DEADLINE_S) + CHECKPOINT_GRACE_S
