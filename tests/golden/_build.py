"""The golden event streams: one scenario per rule of docs/design.md §4/§5, with hand-written
expectations. ``python -m tests.golden._build`` writes them as JSON fixtures beside this file;
``tests/projections/test_golden.py`` replays the fixtures through the fold (and checks that they
are what this file builds, so the two cannot drift apart).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from rolloutlog.log import Event
from tests import factories as f

HERE = Path(__file__).resolve().parent
ENV = f.participant("environment", "env-0", 1)
AGENT = f.participant("agent", "agent-0", 1)
POLICY = f.participant("policy", "policy-0", 1)
RES = f.participant("resources", "res-0", 1)


class Stream:
    """Builds one episode's stream with consecutive offsets and per-writer seqs."""

    def __init__(self, episode: str = "r17") -> None:
        self.episode = episode
        self.events: list[tuple[int, Event]] = []
        self.offset = 0
        self.seqs: dict[tuple[str, int], int] = {}

    def add(self, builder: Any, *args: Any, who: dict[str, Any] = ENV, **kw: Any) -> int:
        key = (who["id"], who["epoch"])
        seq = kw.pop("seq", None)
        if seq is None:
            seq = self.seqs.get(key, 0) + 1
        self.seqs[key] = max(self.seqs.get(key, 0), seq)
        event = builder(self.episode, *args, who=who, seq=seq, ts=1764400000.0 + self.offset, **kw)
        self.events.append((self.offset, event))
        self.offset += 1
        return self.offset - 1

    def raw(self, type_: str, data: dict[str, Any], who: dict[str, Any] = ENV, **kw: Any) -> int:
        def build(episode: str, **inner: Any) -> Event:
            from rolloutlog.log import validate_event

            return validate_event(f.envelope(type_, episode, data, **inner))

        return self.add(build, who=who, **kw)

    def skip(self, n: int = 1) -> None:
        """Offsets taken by other episodes sharing the partition."""
        self.offset += n


def session_started(stream: Stream, sid: str, mode: str, verify: str = "replay", **kw: Any) -> int:
    return stream.raw(
        "session.started",
        {"session_id": sid, "mode": mode, "verify": verify},
        who=kw.pop("who", RES),
        **kw,
    )


def scenarios() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}

    def scenario(
        name: str, rule: str, s: Stream, cut: int, expect: dict[str, Any], **extra: Any
    ) -> None:
        out[name] = {"rule": rule, "stream": s, "cut": cut, "expect": expect, **extra}

    # §4.2/4.3 the committed prefix ends at the last boundary; the tail is dropped.
    s = Stream()
    s.add(f.started)
    s.add(f.boundary, "seed", {"turn": 1}, "invoke_agent")
    s.add(f.session_state, "s1", {"counter": 1}, who=RES)
    cut = s.offset
    scenario(
        "tail_dropped",
        "§4.2-3: events after the last boundary are not folded",
        s,
        cut,
        {"status": "live", "boundaries": {"environment": "seed"}, "sessions": {}, "ledger": []},
    )

    # §4.2 the latest boundary per owner (environment and an agent session).
    s = Stream()
    s.add(f.started)
    s.add(f.boundary, "seed", {"turn": 1})
    s.raw(
        "step.boundary",
        {"owner": "agent-s1", "stage": "model_call", "next": None, "state": {"i": 1}},
        who=AGENT,
    )
    s.raw(
        "step.boundary",
        {"owner": "agent-s1", "stage": "tool_round", "next": None, "state": {"i": 2}},
        who=AGENT,
    )
    s.add(f.boundary, "invoke_agent", {"turn": 2})
    scenario(
        "latest_boundary_per_owner",
        "§4.2: the latest boundary of every owner is folded",
        s,
        s.offset,
        {
            "boundaries": {"environment": "invoke_agent", "agent-s1": "tool_round"},
            "boundary_states": {"environment": {"turn": 2}, "agent-s1": {"i": 2}},
        },
    )

    # §4.2 open sessions with mode, verify and their latest state; ended sessions leave.
    s = Stream()
    s.add(f.started)
    session_started(s, "s1", "exported", "wait")
    s.add(f.session_state, "s1", {"counter": 1}, who=RES)
    session_started(s, "s2", "stateless")
    s.add(f.session_state, "s1", {"counter": 2}, who=RES)
    s.raw("session.ended", {"session_id": "s2"}, who=RES)
    s.add(f.boundary, "seed", {"turn": 1})
    scenario(
        "sessions_latest_state",
        "§4.2: the latest state of every open session",
        s,
        s.offset,
        {"sessions": {"s1": {"mode": "exported", "verify": "wait", "state": {"counter": 2}}}},
    )

    # §4.3 ledger rows of the committed prefix are kept; rows in the tail are dropped.
    s = Stream()
    s.add(f.started)
    root = f.ledger_row("r17", "c1", [1, 2, 3])
    s.add(f.ledger_row, "c1", [1, 2, 3], who=POLICY)
    s.add(f.boundary, "invoke_agent", {"turn": 1})
    s.add(
        f.ledger_row,
        "c2",
        [4, 5],
        {"call_id": "c1", "cum_len": 3, "digest": root.data.digest},
        who=POLICY,
    )
    scenario(
        "tail_ledger_rows_dropped",
        "§4.3: ledger rows of undelivered calls (in the tail) are dropped",
        s,
        s.offset,
        {"ledger": ["c1"], "generation_cut": None, "staging_keys": ["stage-r17-c1"]},
    )

    # §4.3 the generation cut: chunks of the tail's latest call form a durable prefix.
    s = Stream()
    s.add(f.started)
    s.add(f.ledger_row, "c1", [1, 2, 3], who=POLICY)
    s.add(f.boundary, "invoke_agent", {"turn": 1})
    s.add(f.chunk, "c2", 0, 4, who=POLICY)
    s.add(f.chunk, "c2", 4, 4, who=POLICY)
    scenario(
        "generation_cut_active",
        "§4.3: the tail's in-flight call is cut at its durable token prefix",
        s,
        s.offset,
        {"generation_cut": {"call_id": "c2", "tokens": 8, "terminal": False}},
    )

    # §4.3 a call that completed in the tail but was never delivered is a terminal cut.
    s = Stream()
    s.add(f.started)
    s.add(f.boundary, "invoke_agent", {"turn": 1})
    s.add(f.chunk, "c2", 0, 4, who=POLICY)
    s.raw(
        "generation.chunk",
        {
            "call_id": "c2",
            "parent_call_id": "c1",
            "request_digest": "req",
            "start": 4,
            "token_ids": [9],
            "policy_version": 1,
            "done": True,
        },
        who=POLICY,
    )
    scenario(
        "generation_cut_terminal",
        "§4.3: a completed, undelivered call is a terminal cut",
        s,
        s.offset,
        {"generation_cut": {"call_id": "c2", "tokens": 5, "terminal": True}},
    )

    # §4.3 constrained calls are never cut.
    s = Stream()
    s.add(f.started)
    s.add(f.boundary, "invoke_agent", {"turn": 1})
    s.add(f.chunk, "c2", 0, 4, who=POLICY)
    s.raw(
        "ledger.row",
        {
            "call_id": "c2",
            "parent_call_id": None,
            "fingerprint": "fp",
            "context_digest": "cd",
            "policy_version": 1,
            "prev_len": 0,
            "token_ids": [1],
            "cum_len": 1,
            "digest": f.ledger_digest("", [1]),
            "staging_key": None,
            "constrained": True,
        },
        who=POLICY,
    )
    scenario(
        "generation_cut_never_constrained",
        "§4.3: calls with constrained decoding are never cut",
        s,
        s.offset,
        {"generation_cut": None},
    )

    # §4.3 a boundary after the chunks consumes them: no cut.
    s = Stream()
    s.add(f.started)
    s.add(f.chunk, "c2", 0, 4, who=POLICY)
    s.add(f.boundary, "invoke_agent", {"turn": 1})
    scenario(
        "generation_cut_consumed",
        "§4.3: chunks before the last boundary are no cut",
        s,
        s.offset,
        {"generation_cut": None},
    )

    # §4.4 a wait step without a later boundary of its owner is open at the cut.
    s = Stream()
    s.add(f.started)
    s.add(f.boundary, "invoke_agent", {"turn": 1})
    s.add(f.step_started, "close_agent", "wait")
    scenario(
        "wait_step_open",
        "§4.4: an open wait step is reported",
        s,
        s.offset,
        {"open_waits": ["environment"]},
    )

    s = Stream()
    s.add(f.started)
    s.add(f.step_started, "close_agent", "wait")
    s.add(f.boundary, "close_agent", {"obs": 1})
    s.add(f.step_started, "verify", "replay")
    scenario(
        "wait_step_closed",
        "§4.4: a boundary of its owner closes a wait step",
        s,
        s.offset,
        {"open_waits": [], "boundaries": {"environment": "close_agent"}},
    )

    # §4.5 finished before the cut / after the cut.
    s = Stream()
    s.add(f.started)
    s.add(f.boundary, "verify", {"ok": True})
    s.add(f.finished, 0.5, {"answer": 42})
    scenario(
        "finished_before_cut",
        "§4.5: episode.finished before the cut means finished",
        s,
        s.offset,
        {"status": "finished", "reward": 0.5},
    )
    scenario(
        "finished_after_cut",
        "§4.1: nothing at or after the cut is folded",
        s,
        s.offset - 1,
        {"status": "live"},
    )

    # §4.5 a live restart_only session at the cut.
    s = Stream()
    s.add(f.started)
    session_started(s, "s1", "restart_only")
    s.add(f.boundary, "seed", {"turn": 0})
    scenario(
        "restart_only_session",
        "§4.5: a live restart_only session makes the episode restart",
        s,
        s.offset,
        {"restart_only": ["s1"]},
    )

    # §5 duplicates are dropped (same participant, epoch and seq).
    s = Stream()
    s.add(f.started)
    s.add(f.boundary, "seed", {"turn": 1})
    s.add(f.boundary, "seed", {"turn": "duplicate"}, seq=2)
    scenario(
        "duplicates_dropped",
        "§5: a repeated (participant, epoch, seq) is dropped",
        s,
        s.offset,
        {"boundary_states": {"environment": {"turn": 1}}, "events_folded": 2},
    )

    # §5 zombies: a lower epoch after a higher epoch's first event is ignored.
    s = Stream()
    s.add(f.started)
    s.add(f.boundary, "seed", {"turn": 1}, who=f.participant("environment", "env-0", 2))
    s.add(f.boundary, "invoke_agent", {"turn": "zombie"}, who=ENV)
    scenario(
        "zombie_epoch_ignored",
        "§5: events of a superseded participant epoch are ignored",
        s,
        s.offset,
        {"boundaries": {"environment": "seed"}},
    )

    # §5 a committed restore fences the old attempt; the new one continues its projection at the cut.
    s = Stream()
    s.add(f.started)
    s.add(f.boundary, "seed", {"turn": 1})
    restore_cut = s.offset
    s.add(f.boundary, "invoke_agent", {"turn": "after the cut"})
    s.raw(
        "attempt.started",
        {"restore_id": 1, "checkpoint_id": 1, "previous_attempt": 0, "cut": restore_cut},
        who=f.participant("service", "rolloutlog", 1),
        attempt=1,
    )
    s.add(f.boundary, "close_agent", {"turn": "zombie attempt"})
    s.add(f.boundary, "invoke_agent", {"turn": 2}, attempt=1)
    scenario(
        "attempt_chain",
        "§5/§6: attempt n+1 continues attempt n's projection at its cut; attempt n is fenced",
        s,
        s.offset,
        {
            "attempt": 1,
            "boundaries": {"environment": "invoke_agent"},
            "boundary_states": {"environment": {"turn": 2}},
            "events_folded": 3,
        },
        committed_restores=[1],
    )
    scenario(
        "uncommitted_restore_ignored",
        "§6: an attempt.started of a restore that never committed changes nothing",
        s,
        s.offset,
        {"attempt": 0, "boundaries": {"environment": "close_agent"}},
        committed_restores=[],
    )

    # §4 consequence: an unconsumed generation cut survives a second checkpoint.
    s = Stream()
    s.add(f.started)
    s.add(f.boundary, "invoke_agent", {"turn": 1})
    s.add(f.chunk, "c2", 0, 4, who=POLICY)
    restore_cut = s.offset
    s.raw(
        "attempt.started",
        {"restore_id": 1, "checkpoint_id": 1, "previous_attempt": 0, "cut": restore_cut},
        who=f.participant("service", "rolloutlog", 1),
        attempt=1,
    )
    s.add(f.step_started, "invoke_agent", "replay", attempt=1)
    scenario(
        "unconsumed_cut_survives",
        "§4: a generation cut the replacement has not consumed survives the next checkpoint",
        s,
        s.offset,
        {"attempt": 1, "generation_cut": {"call_id": "c2", "tokens": 4, "terminal": False}},
        committed_restores=[1],
    )

    # §4.3 across a restore: the old attempt's tail (an undelivered call's ledger row, a session
    # change after its last boundary) was dropped by the restore and stays dropped when the new
    # attempt's first boundary commits; the tail's generation cut is what the new attempt continues.
    s = Stream()
    s.add(f.started)
    s.add(f.boundary, "invoke_agent", {"turn": 1})
    s.add(f.session_state, "s1", {"counter": 7}, who=RES)
    s.add(f.ledger_row, "c1", who=POLICY)
    s.add(f.chunk, "c2", 0, 4, who=POLICY)
    restore_cut = s.offset
    s.raw(
        "attempt.started",
        {"restore_id": 1, "checkpoint_id": 1, "previous_attempt": 0, "cut": restore_cut},
        who=f.participant("service", "rolloutlog", 1),
        attempt=1,
    )
    s.add(f.boundary, "close_agent", {"turn": 2}, attempt=1)
    scenario(
        "tail_dropped_across_restore",
        "§4.3/§6: an old attempt's tail stays dropped after its replacement's first boundary",
        s,
        s.offset,
        {
            "attempt": 1,
            "boundaries": {"environment": "close_agent"},
            "sessions": {},
            "ledger": [],
            "staging_keys": [],
            "generation_cut": None,
        },
        committed_restores=[1],
    )

    # §4.1 markers belong to no episode.
    s = Stream()
    s.add(f.started)
    s.raw("step.boundary", {"owner": "environment", "stage": "seed", "next": None, "state": 1})
    scenario(
        "events_at_cut_excluded",
        "§4.1: the event at the cut itself is not folded",
        s,
        s.offset - 1,
        {"boundaries": {}, "events_folded": 1},
    )
    return out


def to_fixture(name: str, body: dict[str, Any]) -> dict[str, Any]:
    stream: Stream = body["stream"]
    return {
        "name": name,
        "rule": body["rule"],
        "episode": stream.episode,
        "cut": body["cut"],
        "committed_restores": body.get("committed_restores"),
        "events": [
            {
                "offset": offset,
                "event": orjson.loads(orjson.dumps(event.model_dump(), default=_raw)),
            }
            for offset, event in stream.events
        ],
        "expect": body["expect"],
    }


def _raw(value: Any) -> Any:
    from rolloutlog.log import Opaque

    if isinstance(value, Opaque):
        return orjson.Fragment(value.raw)
    raise TypeError(type(value))


def fixtures() -> dict[str, dict[str, Any]]:
    return {name: to_fixture(name, body) for name, body in scenarios().items()}


def write() -> None:
    for old in HERE.glob("*.json"):
        old.unlink()
    for name, fixture in fixtures().items():
        (HERE / f"{name}.json").write_bytes(
            orjson.dumps(fixture, option=orjson.OPT_INDENT_2) + b"\n"
        )


if __name__ == "__main__":
    write()
