"""Property-based tests (hypothesis) of the fold and of checkpoint/restore planning.

Streams are random interleavings of several episodes' events with duplicates (retries), zombie
participant epochs, tail events after the last boundary, a random cut and restores. The
properties come from docs/design.md §4-§6:

- no event at or after a cut is ever folded in;
- the projector's trackers (the fold without payloads) agree with the full fold;
- duplicates and zombies never reach a projection;
- a restored resources state always matches the restored boundary (the resources server records
  its state before replying, the environment its boundary after);
- every episode of a checkpoint lands in exactly one of finished / continued / restarted / excluded.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutlog.log import Event
from rolloutlog.projections import CheckpointResult, project_events
from tests import factories as f
from tests.projections.both_modes import check_both_modes
from tests.projections.conftest import open_service

ENV1 = f.participant("environment", "env-0", 1)
ENV2 = f.participant("environment", "env-0", 2)
RES = f.participant("resources", "res-0", 1)


@st.composite
def episode_script(draw: st.DrawFn, episode: str) -> list[tuple[str, Event]]:
    """One episode's events in order, each tagged good (may be folded) or bad (must never be)."""
    steps = draw(st.integers(1, 6))
    zombie_from = draw(st.integers(1, steps + 1))  # the environment restarts (epoch 2) here
    seqs = {"env1": 0, "env2": 0, "res": 0}
    out: list[tuple[str, Event]] = []

    def seq(who: str) -> int:
        seqs[who] += 1
        return seqs[who]

    out.append(("good", f.started(episode, who=ENV1, seq=seq("env1"))))
    out.append(("good", f.session_started(episode, "s1", "exported", who=RES, seq=seq("res"))))
    for k in range(1, steps + 1):
        env, env_key = (ENV2, "env2") if k >= zombie_from else (ENV1, "env1")
        out.append(("good", f.session_state(episode, "s1", {"k": k}, who=RES, seq=seq("res"))))
        if draw(st.booleans()):  # a retry of the state just recorded, with other content
            out.append(("bad", f.session_state(episode, "s1", {"k": -1}, who=RES, seq=seqs["res"])))
        out.append(("good", f.boundary(episode, f"step{k}", {"k": k}, who=env, seq=seq(env_key))))
        if k >= zombie_from and draw(st.booleans()):  # the old process is still writing
            out.append(("bad", f.boundary(episode, "zombie", {"k": -2}, who=ENV1, seq=seq("env1"))))
    if draw(st.booleans()):  # a step in flight: recorded state without its boundary yet
        out.append(
            ("tail", f.session_state(episode, "s1", {"k": steps + 1}, who=RES, seq=seq("res")))
        )
    return out


@st.composite
def interleaving(draw: st.DrawFn) -> tuple[list[tuple[int, str, Event]], int]:
    """Several episodes' scripts merged in a random order that keeps each episode's own order."""
    names = [f"r{i}" for i in range(draw(st.integers(1, 4)))]
    scripts = {name: draw(episode_script(name)) for name in names}
    cursors = dict.fromkeys(names, 0)
    merged: list[tuple[int, str, Event]] = []
    while any(cursors[n] < len(scripts[n]) for n in names):
        ready = [n for n in names if cursors[n] < len(scripts[n])]
        name = draw(st.sampled_from(ready))
        tag, event = scripts[name][cursors[name]]
        merged.append((len(merged), tag, event))
        cursors[name] += 1
    cut = draw(st.integers(0, len(merged)))
    return merged, cut


def state(value: Any) -> Any:
    return value.value() if value is not None else None


@settings(max_examples=300, deadline=None)
@given(interleaving())
def test_fold_properties(stream: tuple[list[tuple[int, str, Event]], int]) -> None:
    merged, cut = stream
    for episode in {event.episode for _, _, event in merged}:
        events = [(offset, event) for offset, _, event in merged if event.episode == episode]
        projection = project_events(str(episode), events, cut)
        # The projector's trackers (no payloads) agree with the full fold.
        assert check_both_modes(str(episode), events, cut) == projection
        before_cut = [(o, tag, e) for o, tag, e in merged if e.episode == episode and o < cut]
        good_boundaries = [
            e for _, tag, e in before_cut if tag == "good" and e.type == "step.boundary"
        ]
        env = projection.boundaries.get("environment")
        # The committed prefix ends at the last good boundary before the cut.
        if good_boundaries:
            assert env is not None
            assert state(env.state) == good_boundaries[-1].data.state.value()
            # The restored resources state matches the restored boundary.
            assert state(projection.sessions["s1"].state) == state(env.state)
        else:
            assert env is None
        # Nothing bad, and nothing at or after the cut.
        for b in projection.boundaries.values():
            assert state(b.state)["k"] > 0
            assert b.offset < cut
        for s in projection.sessions.values():
            if s.state is not None:
                assert state(s.state)["k"] > 0
        if projection.first_offset is not None:
            assert projection.first_offset < cut


FATES = ["live", "finished", "restart_only", "finished_late", "tail_only"]


@st.composite
def fleet(draw: st.DrawFn) -> tuple[dict[str, str], list[str], list[str]]:
    count = draw(st.integers(1, 6))
    fates = {f"e{i}": draw(st.sampled_from(FATES)) for i in range(count)}
    order = draw(st.permutations(sorted(fates)))
    exclude = draw(st.lists(st.sampled_from(sorted(fates)), unique=True))
    return fates, list(order), exclude


async def run_fleet(
    data_dir: Path, fates: dict[str, str], order: list[str], exclude: list[str]
) -> None:
    service = await open_service(data_dir, partitions=3)
    try:
        for episode in order:
            fate = fates[episode]
            events = [f.started(episode)]
            if fate == "restart_only":
                events.append(f.session_started(episode, "s1", "restart_only"))
            events.append(f.boundary(episode, "seed", {"e": episode}))
            if fate == "finished":
                events.append(f.finished(episode))
            if fate == "tail_only":
                events.append(f.step_started(episode, "invoke_agent", "replay"))
            await service.append(*events)
        first = await service.checkpoint()
        assert isinstance(first, CheckpointResult)
        for episode in order:
            if fates[episode] == "finished_late":
                await service.append(f.finished(episode))
        entries = await service.catalog.load_manifest("run", first.checkpoint.checkpoint_id)
        in_manifest = {e.episode: e.action for e in entries}
        assert set(in_manifest) == set(fates)
        excluded = [e for e in exclude if e in in_manifest]
        result = await service.restore(exclude=excluded)
        plan = {e.episode: e.action for e in result.entries}
        finished = {e for e, a in in_manifest.items() if a == "finished" and e not in excluded}
        # Exactly one of finished / continued / restarted / excluded, none lost, none twice.
        assert set(plan).isdisjoint(finished)
        assert set(plan) | finished == set(fates)
        for episode, action in plan.items():
            if episode in excluded:
                assert action == "excluded"
            elif in_manifest[episode] == "restart":
                assert action == "restart"
            else:
                assert action == "continue"
        # A second checkpoint (a crash before anyone resumed) keeps every survivor, once.
        second = await service.checkpoint()
        assert isinstance(second, CheckpointResult)
        survivors = {e for e, a in plan.items() if a != "excluded"}
        later = {
            e.episode
            for e in await service.catalog.load_manifest("run", second.checkpoint.checkpoint_id)
        }
        assert later == survivors
    finally:
        await service.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet())
def test_every_episode_lands_in_exactly_one_outcome(
    plan: tuple[dict[str, str], list[str], list[str]],
) -> None:
    fates, order, exclude = plan
    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(run_fleet(Path(directory), fates, order, exclude))
