"""The benchmark workloads, generated deterministically and shared by every system measured.

Each workload is a list of episodes; an episode is the list of envelopes (docs/design.md §3, plain
dicts) its participants append, in order. rolloutlog gets them through the SDK's transports (or
``rolloutlog.log`` for bulk preloads); the baselines get the same envelopes (stop-the-world: each
participant's live state folded from them; pyeventsourcing: one aggregate event per envelope).

- S1: live rollouts of ~10 committed events each (episode.started, a resources session, two
  ledger rows of 512 token ids each with a session state and a boundary) and an in-flight
  generation (a step started, a generation chunk);
- S2: live rollouts each holding one resources session state of ``state_bytes`` (350 KB);
- S3: finished and live rollouts with three-row ledgers (the seed's lineage import: 15,686 live
  rollouts' ledgers to restore, 2,000 finished ones it must skip);
- S4: S1, plus churn episodes that participants append while checkpoints are taken
  (``churn_batch``).

Between two measured checkpoints, ``Workload.advance`` moves a fixed number of live rollouts on
by one event each (the next session state, or a boundary where the workload has no session):
the churn of a live run, the same count at every size.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rolloutlog.core import ledger_digest, task_digest

TS = 1764400000.0


#: Token-id patterns: episode ``i`` uses pattern ``i % PATTERNS``. The lists (and their digest
#: chains) are built once and shared between episodes, so that generating 64,000 episodes costs
#: seconds and holding 16,000 costs little memory; every episode still carries all its ids.
PATTERNS = 64


@functools.cache
def _ledger_chain(pattern: int, rows: int, tokens: int) -> tuple[tuple[list[int], str], ...]:
    chain, parent = [], ""
    for call in range(rows):
        ids = [(pattern * 7 + call * 13 + t) % 50_000 for t in range(tokens)]
        parent = ledger_digest(parent, ids)
        chain.append((ids, parent))
    return tuple(chain)


@functools.cache
def _chunk_ids() -> list[int]:
    return list(range(64))


class _Builder:
    """Envelopes of one episode with per-participant ``seq`` (increasing in episode order)."""

    def __init__(self, episode: str, index: int, shard: int) -> None:
        self.episode = episode
        self.index = index
        self.shard = shard
        self.counts: dict[str, int] = {}
        self.events: list[dict[str, Any]] = []

    def add(self, kind: str, type_: str, data: dict[str, Any], step: int | None = None) -> None:
        pid = f"{kind}-{self.shard}"
        self.counts[pid] = self.counts.get(pid, 0) + 1
        self.events.append(
            {
                "v": 1,
                "episode": self.episode,
                "attempt": 0,
                "step": step,
                "participant": {"id": pid, "kind": kind, "epoch": 1},
                "seq": self.index * 100 + self.counts[pid],
                "ts": TS,
                "type": type_,
                "data": data,
            }
        )

    def started(self, task: dict[str, Any]) -> None:
        self.add(
            "environment",
            "episode.started",
            {"task": task, "task_digest": task_digest(task), "deadline_s": 3600.0},
        )

    def ledger(self, rows: int, tokens: int, staging: bool = True) -> None:
        cum = 0
        for call, (ids, digest) in enumerate(_ledger_chain(self.index % PATTERNS, rows, tokens)):
            self.add(
                "policy",
                "ledger.row",
                {
                    "call_id": f"c{call}",
                    "parent_call_id": f"c{call - 1}" if call else None,
                    "fingerprint": f"fp{self.index}-{call}",
                    "context_digest": f"cd{call}",
                    "policy_version": 1,
                    "prev_len": cum,
                    "token_ids": ids,
                    "cum_len": cum + tokens,
                    "digest": digest,
                    "staging_key": f"stage-{self.episode}-{call}" if staging else None,
                    "constrained": False,
                },
                step=call,
            )
            self.add(
                "environment",
                "step.boundary",
                {
                    "owner": "environment",
                    "stage": "invoke_agent",
                    "next": "invoke_agent",
                    "state": {"turn": call},
                },
                step=call,
            )
            cum += tokens


SHARDS = 4


def s1_episode(index: int, prefix: str = "r") -> list[dict[str, Any]]:
    """10 events: start, session, 2 x (ledger row of 512 ids, session state, boundary), a step in
    flight with a generation chunk of 64 ids."""
    b = _Builder(f"{prefix}{index}", index, index % SHARDS)
    b.started({"prompt": f"solve task {index}", "id": index})
    b.add(
        "resources", "session.started", {"session_id": "s1", "mode": "exported", "verify": "replay"}
    )
    cum = 0
    for call, (ids, digest) in enumerate(_ledger_chain(index % PATTERNS, 2, 512)):
        b.add(
            "policy",
            "ledger.row",
            {
                "call_id": f"c{call}",
                "parent_call_id": f"c{call - 1}" if call else None,
                "fingerprint": f"fp{index}-{call}",
                "context_digest": f"cd{call}",
                "policy_version": 1,
                "prev_len": cum,
                "token_ids": ids,
                "cum_len": cum + 512,
                "digest": digest,
                "staging_key": f"stage-{index}-{call}",
                "constrained": False,
            },
            step=call,
        )
        cum += 512
        b.add(
            "resources",
            "session.state",
            {"session_id": "s1", "state": {"turn": call, "files": ["a.py"]}},
            step=call,
        )
        b.add(
            "environment",
            "step.boundary",
            {
                "owner": "environment",
                "stage": "invoke_agent",
                "next": "invoke_agent",
                "state": {"turn": call},
            },
            step=call,
        )
    b.add(
        "environment",
        "step.started",
        {"owner": "environment", "stage": "invoke_agent", "mode": "replay"},
        step=2,
    )
    b.add(
        "policy",
        "generation.chunk",
        {
            "call_id": "c2",
            "parent_call_id": "c1",
            "request_digest": "rq",
            "start": 0,
            "token_ids": _chunk_ids(),
            "policy_version": 1,
            "staging_key": f"stage-{index}-2",
        },
        step=2,
    )
    return b.events


def state_blob(size: int, seed: int = 7) -> dict[str, Any]:
    """A session state of about ``size`` bytes of JSON (incompressible hex)."""
    return {"sandbox": random.Random(seed).randbytes(max(1, size // 2)).hex()}


def state_episode(index: int, blob: dict[str, Any], prefix: str = "big") -> list[dict[str, Any]]:
    """4 events: start, an exported resources session, its state (``blob``), a boundary."""
    b = _Builder(f"{prefix}{index}", index, index % SHARDS)
    b.started({"prompt": f"sandbox {index}"})
    b.add(
        "resources", "session.started", {"session_id": "s1", "mode": "exported", "verify": "replay"}
    )
    b.add("resources", "session.state", {"session_id": "s1", "state": blob})
    b.add(
        "environment",
        "step.boundary",
        {"owner": "environment", "stage": "seed", "next": "invoke_agent", "state": {"ok": 1}},
    )
    return b.events


def s3_episode(index: int, finished: bool) -> list[dict[str, Any]]:
    """A rollout with a three-row ledger (256 ids per row); ``finished`` ones end before the cut."""
    b = _Builder(f"lin{index}", index, index % SHARDS)
    b.started({"prompt": f"lineage {index}"})
    b.ledger(rows=3, tokens=256)
    if finished:
        b.add("environment", "episode.finished", {"reward": 1.0, "result": {"ok": True}})
    return b.events


def churn_batch(writer: int, epoch: int, first: int, count: int) -> list[dict[str, Any]]:
    """S4's load: ``count`` small boundaries of one writer's churn episodes (each writer is its own
    environment participant with the ``epoch`` it registered, ``seq`` = ``first`` + k)."""
    pid = f"churn-{writer}"
    out = []
    for k in range(count):
        seq = first + k
        episode = f"w{writer}x{epoch}e{seq // 50}"
        event: dict[str, Any] = {
            "v": 1,
            "episode": episode,
            "attempt": 0,
            "step": None,
            "participant": {"id": pid, "kind": "environment", "epoch": epoch},
            "seq": seq,
            "ts": TS + seq,
        }
        if seq % 50 == 0:
            task = {"prompt": f"churn {episode}"}
            event["type"] = "episode.started"
            event["data"] = {"task": task, "task_digest": task_digest(task), "deadline_s": 600.0}
        else:
            event["type"] = "step.boundary"
            event["step"] = seq % 50
            event["data"] = {
                "owner": "environment",
                "stage": "invoke_agent",
                "next": "invoke_agent",
                "state": {"turn": seq % 50, "note": "x" * 100},
            }
        out.append(event)
    return out


@dataclass(frozen=True)
class Workload:
    """A named workload: ``count`` episodes built by ``episode(index)``."""

    name: str
    count: int
    live: int
    state_bytes: int = 0
    finished: int = 0

    def episodes(self) -> Iterator[list[dict[str, Any]]]:
        if self.name in ("S1", "S4", "live"):
            for index in range(self.count):
                yield s1_episode(index)
        elif self.name in ("S2", "state"):
            blob = state_blob(self.state_bytes)
            for index in range(self.count):
                yield state_episode(index, blob)
        elif self.name == "S3":
            # The finished ones interleaved, so that every partition holds some of each.
            live = set(self.live_indexes())
            for index in range(self.count):
                yield s3_episode(index, index not in live)
        else:
            raise ValueError(f"unknown workload {self.name}")

    def live_indexes(self) -> list[int]:
        """The indexes of the episodes that stay live (S3 finishes some)."""
        if self.name != "S3" or not self.finished:
            return list(range(self.count))
        every, made, out = max(1, self.count // self.finished), 0, []
        for index in range(self.count):
            finished = index % every == every - 1 and made < self.finished
            made += finished
            if not finished:
                out.append(index)
        return out

    def advance(self, round_: int, rollouts: int, epoch: int) -> list[dict[str, Any]]:
        """One more event for each of ``rollouts`` live episodes (spread over the workload,
        others each round): a new state of the exported session (S1, S2 and their curves,
        appended by ``resources-{shard}``) or a boundary (S3, ``environment-{shard}``).
        Participants append them with the ``epoch`` they registered again with."""
        live = self.live_indexes()
        count = min(rollouts, len(live))
        stride = max(1, len(live) // count)
        sessions = self.name != "S3"
        prefix = {"S3": "lin", "S2": "big", "state": "big"}.get(self.name, "r")
        out = []
        for k in range(count):
            index = live[(k * stride + round_) % len(live)]
            kind = "resources" if sessions else "environment"
            event: dict[str, Any] = {
                "v": 1,
                "episode": f"{prefix}{index}",
                "attempt": 0,
                "step": 2 if self.name in ("S1", "live") else None,
                "participant": {"id": f"{kind}-{index % SHARDS}", "kind": kind, "epoch": epoch},
                # Dense from 1 for the new epoch, increasing round after round (a seq more than
                # 2^20 past a participant's highest is refused as poisoning).
                "seq": 1 + round_ * count + k,
                "ts": TS + round_,
            }
            if sessions:
                event["type"] = "session.state"
                event["data"] = {"session_id": "s1", "state": {"turn": 2, "round": round_}}
            else:
                event["type"] = "step.boundary"
                event["step"] = 3 + round_
                event["data"] = {
                    "owner": "environment",
                    "stage": "invoke_agent",
                    "next": "invoke_agent",
                    "state": {"turn": 3 + round_},
                }
            out.append(event)
        return out

    def participants(self) -> list[tuple[str, str]]:
        kinds = ("environment", "resources") if self.name in ("S2", "state") else None
        kinds = kinds or (
            ("environment", "policy")
            if self.name == "S3"
            else ("environment", "policy", "resources")
        )
        return [(f"{kind}-{shard}", kind) for kind in kinds for shard in range(SHARDS)]


def s1(count: int = 16_000) -> Workload:
    return Workload("S1", count, count)


def s2(count: int = 1000, state_bytes: int = 350 * 1024) -> Workload:
    return Workload("S2", count, count, state_bytes=state_bytes)


def s3(live: int = 15_686, finished: int = 2000) -> Workload:
    return Workload("S3", live + finished, live, finished=finished)


def live_point(count: int) -> Workload:
    """A point of the live-rollouts curve (S1's episodes)."""
    return Workload("live", count, count)


def state_point(count: int, state_bytes: int) -> Workload:
    """A point of the state-size curve (S2's episodes with another state size)."""
    return Workload("state", count, count, state_bytes=state_bytes)


def live_states(episodes: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each participant's live in-memory state per episode, folded from its envelopes: what a
    stop-the-world export serializes (the task and latest boundary, the latest session states,
    the ledger rows and the in-flight generation)."""
    states: dict[str, dict[str, Any]] = {}
    finished: set[str] = set()
    for events in episodes:
        for event in events:
            pid = event["participant"]["id"]
            episode_state = states.setdefault(pid, {}).setdefault(event["episode"], {})
            data = event["data"]
            type_ = event["type"]
            if type_ == "episode.started":
                episode_state["task"] = data["task"]
            elif type_ == "step.boundary":
                episode_state["boundary"] = data
            elif type_ == "session.state":
                episode_state.setdefault("sessions", {})[data["session_id"]] = data["state"]
            elif type_ == "session.started":
                episode_state.setdefault("sessions", {}).setdefault(data["session_id"], None)
            elif type_ == "ledger.row":
                episode_state.setdefault("ledger", []).append(data)
            elif type_ == "generation.chunk":
                episode_state["generation"] = data
            elif type_ == "episode.finished":
                finished.add(event["episode"])
    for per_episode in states.values():
        for episode in finished.intersection(per_episode):
            del per_episode[episode]
    return states
