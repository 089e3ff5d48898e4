"""Several service URLs for one trainer client (docs/api.md, "Several service URLs"): the rules
both clients follow to move to the next URL, kept here once (the clients do the I/O).

- A call moves on after a transport error that proves the request never left (connection
  refused, connect timeout), after any transport error of a read-only call (``GET``), and after
  a refusal that wrote nothing and may succeed elsewhere (``unavailable``, a balancer's 502/504
  for a ``GET``). A write whose request may have been taken (a reset or a timeout after it was
  sent) is not sent again: the error is the caller's, as with one URL.
- A checkpoint request is the exception: it may be sent again after any transport error, since
  it carries the call's request id and the catalog tells whether the first one was taken
  (``CheckpointAttempt``): the checkpoint begun for that request id, once committed, is the
  answer (never one another request began); one still pending is asked about again
  (``checkpoint_in_progress`` while its requester lives; superseded, and a new one begun for
  the same request id, once the requester's lease lapsed: never two); otherwise it is
  requested again (the service, finding the request id's checkpoint, answers with it).
  ``checkpoint_in_progress`` is asked again until the deadline (a dead replica's checkpoint is
  superseded once its lease lapsed).
- Every call is bounded: a checkpoint by its deadline (plus the service's grace), others by
  the client's ``failover_s``.
"""

from __future__ import annotations

import time
import uuid
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
    """One checkpoint call over several URLs: its request id (sent with every request of the
    call: the service keeps it on the checkpoint it begins), whether a request of it may have
    been taken, and what the catalog says about that."""

    #: The call's request id (``request_id`` of ``POST …/checkpoints``).
    request_id: str
    #: Set once a request may have been taken (sent, no answer).
    unanswered: bool = False

    @classmethod
    def begin(cls, request_id: str | None = None) -> CheckpointAttempt:
        return cls(request_id if request_id is not None else new_request_id())

    def taken(self, found: Sequence[Mapping[str, Any]], wait: bool) -> Mapping[str, Any] | None:
        """After an unanswered request, given the checkpoints begun for this call's request id
        (``GET …/checkpoints?request_id=…&limit=1``: the newest, or none): the one it began
        once it committed (or, ``wait=False``, while it is pending), else None. While it is
        pending the request is unanswered still: asking again answers
        ``checkpoint_in_progress`` while its requester lives, and supersedes it once the
        requester's lease lapsed (only one of them commits)."""
        for body in found[:1]:
            verdict = self._verdict(body)
            if verdict == "done" or (verdict == "wait" and not wait):
                self.unanswered = False
                return body
            if verdict == "wait":
                return None
        self.unanswered = False  # not taken, or it failed: ask again
        return None

    def _verdict(self, body: Mapping[str, Any]) -> str | None:
        """``"wait"`` when the checkpoint is this call's request's and pending, ``"done"`` when
        it is and committed (or expired since by retention), else None. Only the request id
        says whose it is: a checkpoint another request began (another client of the trainer,
        this client's previous call) is never this call's answer, however recent."""
        if body.get("request_id") != self.request_id:
            return None
        status = body.get("status")
        if status == "pending":
            return "wait"
        return "done" if status in ("committed", "expired") else None


def new_request_id() -> str:
    """A checkpoint request's id: random, so no two calls (of any client) share one."""
    return uuid.uuid4().hex


def checkpoint_answer_s(deadline_s: float | None) -> float:
    """How long one checkpoint request may go unanswered: the service answers by its deadline
    plus its grace (5 s); a replica that has not by then is paused or gone (what is left of the
    call's budget asks another whether the checkpoint committed all the same)."""
    return (deadline_s or DEFAULT_CHECKPOINT_DEADLINE_S) + CHECKPOINT_ANSWER_GRACE_S


def checkpoint_budget_s(deadline_s: float | None) -> float:
    """How long a checkpoint call moves between URLs."""
    return (deadline_s or DEFAULT_CHECKPOINT_DEADLINE_S) + CHECKPOINT_GRACE_S
