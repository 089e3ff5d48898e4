"""The restore planner on tables of cases: no log, no catalog (``plan_restore`` is pure)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest

from rolloutlog.catalog import ManifestEntry, PartitionOffset
from rolloutlog.core._model import BoundaryView, SessionView
from rolloutlog.core._planner import (
    EXCLUDED_BY_TRAINER,
    MANIFEST_SAYS_RESTART,
    NO_EVENTS_BEFORE_CUT,
    RestorePolicy,
    begun_after_reason,
    check_exclusions,
    not_exported_reason,
    plan_restore,
    replay_start,
    restart_only_reason,
    to_continue,
    wait_expired_reason,
)
from rolloutlog.errors import UnknownEpisode
from rolloutlog.log import Event
from rolloutlog.projections import EpisodeProjection, project_events
from tests import factories as f

CHECKPOINT = 7
AFTER = begun_after_reason(CHECKPOINT)


def projected(episode: str, *events: Event) -> EpisodeProjection:
    return project_events(episode, list(enumerate(events)), len(events))


def good(episode: str) -> EpisodeProjection:
    return projected(episode, f.started(episode), f.boundary(episode, "seed", {"t": 1}))


def lagging(episode: str) -> EpisodeProjection:
    """A committed ledger at policy version 1 (older than 10 - 2)."""
    return projected(
        episode, f.started(episode), f.ledger_row(episode, policy_version=1), f.boundary(episode)
    )


def with_cut(episode: str) -> EpisodeProjection:
    """An open generation (policy version 1) after a committed ledger row."""
    row = f.ledger_row(episode, token_ids=[1, 2, 3], policy_version=1)
    return projected(episode, f.started(episode), row, f.boundary(episode), f.chunk(episode))


def no_start(episode: str) -> EpisodeProjection:
    return projected(episode, f.boundary(episode))


def bad_digest(episode: str) -> EpisodeProjection:
    return dataclasses.replace(good(episode), task_digest="0" * 64)


def entry(
    episode: str,
    action: str = "continue",
    attempt: int = 0,
    cut: int = 40,
    reason: str | None = None,
) -> ManifestEntry:
    return ManifestEntry(episode, attempt, action, 0, cut, reason=reason)  # type: ignore[arg-type]


class Pin:
    """A pinned tracker's stand-in: its state at the cut has this verdict."""

    def __init__(self, verdict: str | None) -> None:
        self._verdict = verdict

    def pinned_state(self) -> Pin:
        return self

    def verdict(self) -> str | None:
        return self._verdict


@dataclass
class Case:
    manifest: list[ManifestEntry]
    #: (episode, previous attempt, attempt, action, reason, cut, continues from) in plan order;
    #: "continues from" is "pin", "projection" or None.
    expect: list[tuple[str, int, int, str, str | None, int, str | None]]
    projections: dict[str, EpisodeProjection] = field(default_factory=dict)
    pinned: dict[str, Pin] = field(default_factory=dict)
    current: dict[str, int] = field(default_factory=dict)
    begun_after: dict[str, int] = field(default_factory=dict)
    exclude: set[str] = field(default_factory=set)
    policy: RestorePolicy = field(default_factory=RestorePolicy)


CASES: dict[str, Case] = {
    "continue from a replayed projection": Case(
        [entry("a", cut=12)],
        [("a", 0, 1, "continue", None, 12, "projection")],
        projections={"a": good("a")},
    ),
    "continue from a pinned tracker": Case(
        [entry("a", cut=12)],
        [("a", 0, 1, "continue", None, 12, "pin")],
        pinned={"a": Pin(None)},
    ),
    "a pin wins over a projection": Case(
        [entry("a", cut=12)],
        [("a", 0, 1, "continue", None, 12, "pin")],
        pinned={"a": Pin(None)},
        projections={"a": no_start("a")},
    ),
    "restart: the pinned state's verdict": Case(
        [entry("a")],
        [("a", 0, 1, "restart", "task digest does not match the task", 0, None)],
        pinned={"a": Pin("task digest does not match the task")},
    ),
    "restart: the manifest's recorded cause": Case(
        [
            entry(
                "a",
                "restart",
                reason="verify step of resources server res-0 still open at the 30 s deadline",
            )
        ],
        [
            (
                "a",
                0,
                1,
                "restart",
                "verify step of resources server res-0 still open at the 30 s deadline",
                0,
                None,
            )
        ],
    ),
    "restart: the manifest says so (a manifest from before revision 0006)": Case(
        [entry("a", "restart")],
        [("a", 0, 1, "restart", MANIFEST_SAYS_RESTART, 0, None)],
        projections={"a": good("a")},  # never consulted
    ),
    "restart: no events before the cut": Case(
        [entry("a")], [("a", 0, 1, "restart", NO_EVENTS_BEFORE_CUT, 0, None)]
    ),
    "restart: verification fails (no episode.started)": Case(
        [entry("a")],
        [("a", 0, 1, "restart", "no episode.started before the cut", 0, None)],
        projections={"a": no_start("a")},
    ),
    "restart: verification fails (task digest)": Case(
        [entry("a")],
        [("a", 0, 1, "restart", "task digest does not match the task", 0, None)],
        projections={"a": bad_digest("a")},
    ),
    "restart: the policy lag": Case(
        [entry("a")],
        [
            (
                "a",
                0,
                1,
                "restart",
                "ledger policy version 1 is older than 10 - max_policy_lag 2",
                0,
                None,
            )
        ],
        projections={"a": lagging("a")},
        policy=RestorePolicy(10, 2),
    ),
    "continue within the policy lag": Case(
        [entry("a", cut=9)],
        [("a", 0, 1, "continue", None, 9, "projection")],
        projections={"a": lagging("a")},
        policy=RestorePolicy(2, 2),
    ),
    "finished: not in the plan": Case(
        [entry("a", "finished"), entry("b", cut=3)],
        [("b", 0, 1, "continue", None, 3, "projection")],
        projections={"b": good("b")},
    ),
    "excluded: whatever the manifest says": Case(
        [entry("a"), entry("b", "restart"), entry("c", "finished")],
        [
            ("a", 0, 1, "excluded", EXCLUDED_BY_TRAINER, 0, None),
            ("b", 0, 1, "excluded", EXCLUDED_BY_TRAINER, 0, None),
            ("c", 0, 1, "excluded", EXCLUDED_BY_TRAINER, 0, None),
        ],
        projections={"a": good("a")},
        exclude={"a", "b", "c"},
    ),
    "begun after the markers: restart, or excluded if named, in id order": Case(
        [entry("m", cut=5)],
        [
            ("m", 0, 1, "continue", None, 5, "projection"),
            ("x", 2, 3, "excluded", EXCLUDED_BY_TRAINER, 0, None),
            ("y", 0, 1, "restart", AFTER, 0, None),
            ("z", 1, 2, "restart", AFTER, 0, None),
        ],
        projections={"m": good("m")},
        begun_after={"z": 1, "y": 0, "x": 2},
        exclude={"x"},
    ),
    "the catalog's current attempt beats the manifest's and the tracker's": Case(
        [entry("a", attempt=1, cut=5), entry("b", "restart", attempt=0)],
        [
            ("a", 3, 4, "continue", None, 5, "projection"),
            ("b", 1, 2, "restart", MANIFEST_SAYS_RESTART, 0, None),
            ("c", 5, 6, "restart", AFTER, 0, None),
        ],
        projections={"a": good("a")},
        current={"a": 3, "b": 1, "c": 5},
        begun_after={"c": 0},
    ),
    "the manifest's order is kept": Case(
        [entry("b"), entry("a", "restart"), entry("c")],
        [
            ("b", 0, 1, "restart", NO_EVENTS_BEFORE_CUT, 0, None),
            ("a", 0, 1, "restart", MANIFEST_SAYS_RESTART, 0, None),
            ("c", 0, 1, "continue", None, 40, "projection"),
        ],
        projections={"c": good("c")},
    ),
    "nothing to restore": Case([], []),
}


def _session(sid: str, kind: str, participant: str, mode: str) -> SessionView:
    return SessionView(sid, kind, participant, mode, "wait", None)


def _boundary(next_stage: str | None) -> BoundaryView:
    return BoundaryView("x", next_stage, None, 0, 0)


RES = _session("res-0:r1", "resources", "res-0", "exported")
REASONS: dict[str, tuple[str, str]] = {
    "verify step open at the deadline names the resources server": (
        wait_expired_reason(["environment"], {"environment": _boundary("verify")}, {"s": RES}, 30),
        "verify step of resources server res-0 still open at the 30 s deadline",
    ),
    "close_agent step open at the deadline": (
        wait_expired_reason(["environment"], {"environment": _boundary("close_agent")}, {}, 2.5),
        "close_agent step of the environment still open at the 2.5 s deadline",
    ),
    "a wait step before any boundary of the environment is its seed": (
        wait_expired_reason(["environment"], {}, {}, 30),
        "seed step of the environment still open at the 30 s deadline",
    ),
    "an agent's wait step": (
        wait_expired_reason(["agent:r1"], {"agent:r1": _boundary("model_call")}, {}, 30),
        "model_call step of agent:r1 still open at the 30 s deadline",
    ),
    "an agent's wait step before its first boundary": (
        wait_expired_reason(["agent:r1"], {}, {}, 30),
        "wait step of agent:r1 still open at the 30 s deadline",
    ),
    "restart-only resources session": (
        restart_only_reason(
            {"a": _session("tmp:r1", "resources", "tmp", "restart_only"), "b": RES}
        ),
        "restart-only session tmp:r1 of resources server tmp open at the cut",
    ),
    "restart-only agent session (agent without hooks)": (
        restart_only_reason({"a": _session("agent:r1", "agent", "agent-0", "restart_only")}),
        "restart-only session agent:r1 of agent agent-0 (an agent without session hooks) open "
        "at the cut",
    ),
    "session not exported in time": (
        not_exported_reason(["sandbox:r1"], 4),
        "session sandbox:r1 not exported by checkpoint 4's deadline",
    ),
}


@pytest.mark.parametrize("case", list(REASONS.values()), ids=list(REASONS))
def test_reasons_name_their_cause(case: tuple[str, str]) -> None:
    got, expected = case
    assert got == expected


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_plan(case: Case) -> None:
    plan = plan_restore(
        CHECKPOINT,
        case.manifest,
        current=case.current,
        begun_after=case.begun_after,
        exclude=case.exclude,
        pinned=case.pinned,
        projections=case.projections,
        policy=case.policy,
    )
    got = [
        (
            p.entry.episode,
            p.entry.previous_attempt,
            p.entry.attempt,
            p.entry.action,
            p.entry.reason,
            p.cut,
            "pin" if p.from_pin else "projection" if p.projection is not None else None,
        )
        for p in plan.episodes
    ]
    assert got == case.expect
    assert plan.entries == tuple(p.entry for p in plan.episodes)
    continued = {p.entry.episode for p in plan.episodes if p.projection is not None}
    assert set(plan.projections) == continued


def test_the_policy_drops_a_generation_cut_newer_than_its_version() -> None:
    projection = with_cut("a")
    assert projection.generation_cut is not None
    plan = plan_restore(
        CHECKPOINT,
        [entry("a")],
        current={},
        begun_after={},
        projections={"a": projection},
        policy=RestorePolicy(policy_version=0),
    )
    [planned] = plan.episodes
    assert planned.entry.action == "continue"
    assert planned.projection is not None and planned.projection.generation_cut is None
    assert plan.projections["a"].generation_cut is None
    kept = plan_restore(
        CHECKPOINT, [entry("a")], current={}, begun_after={}, projections={"a": projection}
    )
    assert kept.projections["a"].generation_cut is not None


EXCLUSIONS: list[tuple[set[str], list[str] | None]] = [
    (set(), None),
    ({"m"}, None),  # in the manifest
    ({"late"}, None),  # begun after the markers
    ({"nope"}, ["nope"]),
    ({"zz", "m", "aa"}, ["aa", "zz"]),  # sorted, the known ones left out
]


@pytest.mark.parametrize(("exclude", "unknown"), EXCLUSIONS)
def test_unknown_exclusions(exclude: set[str], unknown: list[str] | None) -> None:
    def plan() -> Any:
        return plan_restore(
            CHECKPOINT, [entry("m")], current={}, begun_after={"late": 0}, exclude=exclude
        )

    if unknown is None:
        check_exclusions(CHECKPOINT, exclude, {"m"}, {"late"})
        plan()
        return
    for attempt in (lambda: check_exclusions(CHECKPOINT, exclude, {"m"}, {"late"}), plan):
        with pytest.raises(UnknownEpisode) as raised:
            attempt()
        assert raised.value.details["episodes"] == unknown
        assert f"not in checkpoint {CHECKPOINT}" in raised.value.message


def test_to_continue_leaves_out_excluded_and_other_actions() -> None:
    manifest = [entry("a"), entry("b", "restart"), entry("c", "finished"), entry("d"), entry("e")]
    assert [e.episode for e in to_continue(manifest, {"d"})] == ["a", "e"]


@pytest.mark.parametrize(
    ("offsets", "start"),
    [
        ([], {}),
        ([PartitionOffset(0, 10, 4), PartitionOffset(1, 8, 8)], {0: 4, 1: 8}),
        ([PartitionOffset(0, 10, None), PartitionOffset(2, 3, 0)], {0: 10, 2: 0}),
    ],
)
def test_replay_start_falls_back_to_the_marker(
    offsets: list[PartitionOffset], start: dict[int, int]
) -> None:
    assert replay_start(offsets) == start
