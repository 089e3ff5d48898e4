"""``assign_partitions``: balanced within one partition, sticky (a membership change moves the
fewest partitions a balanced result allows), deterministic, and stable through a handover
(releasing or claiming a partition along the way never redirects the others)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutlog.catalog._leases import assign_partitions

IDS = [f"r{i}" for i in range(6)]


@st.composite
def memberships(draw: st.DrawFn) -> tuple[str, int, dict[int, str | None], list[str]]:
    """A run, its partition count, current owners (some gone or released), and the live ids."""
    run = draw(st.sampled_from(["alpha", "beta", "run-17", "x"]))
    partitions = draw(st.integers(1, 40))
    live = draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=6, unique=True))
    owner = st.one_of(st.none(), st.sampled_from(IDS))
    owners = {p: draw(owner) for p in range(partitions)}
    return run, partitions, owners, live


def minimal_moves(partitions: int, owners: dict[int, str | None], live: list[str]) -> int:
    """The fewest partitions any balanced assignment must move: every partition without a live
    owner, and each live replica's partitions above its final count (at most ``extra`` of them
    may end at ``base + 1``)."""
    base, extra = divmod(partitions, len(live))
    counts = [sum(1 for o in owners.values() if o == r) for r in live]
    orphans = sum(1 for o in owners.values() if o not in live)
    above = sorted((c - base for c in counts if c > base), reverse=True)
    return orphans + sum(above) - min(extra, len(above))


@settings(max_examples=400, deadline=None)
@given(memberships())
def test_balanced_complete_and_minimal(case: tuple[str, int, dict[int, str | None], list[str]]):
    run, partitions, owners, live = case
    assigned = assign_partitions(run, partitions, owners, live)
    assert sorted(assigned) == list(range(partitions))
    assert set(assigned.values()) <= set(live)
    counts = [sum(1 for r in assigned.values() if r == replica) for replica in live]
    assert max(counts) - min(counts) <= 1
    moved = sum(1 for p, r in assigned.items() if owners.get(p) != r)
    assert moved == minimal_moves(partitions, owners, live)
    assert assign_partitions(run, partitions, assigned, live) == assigned  # a fixed point
    assert assign_partitions(run, partitions, owners, list(reversed(live))) == assigned


@settings(max_examples=300, deadline=None)
@given(memberships(), st.randoms(use_true_random=False))
def test_a_handover_in_any_order_reaches_the_first_answer(
    case: tuple[str, int, dict[int, str | None], list[str]], rng: object
) -> None:
    """Replicas release what must go and claim what is theirs, one step at a time in a random
    order (as their ticks come), re-deciding after each step: the target never changes."""
    import random

    assert isinstance(rng, random.Random)
    run, partitions, owners, live = case
    target = assign_partitions(run, partitions, owners, live)
    current: dict[int, str | None] = {p: o if o in live else None for p, o in owners.items()}
    for _ in range(4 * partitions + 4):
        assert assign_partitions(run, partitions, current, live) == target
        pending = [p for p in range(partitions) if current[p] != target[p]]
        if not pending:
            break
        partition = rng.choice(pending)
        # Its owner releases it first (if any), then its new owner claims it.
        current[partition] = None if current[partition] is not None else target[partition]
    assert current == target


def test_a_departure_spreads_over_the_survivors_and_a_newcomer_takes_its_share() -> None:
    three = assign_partitions("run", 16, {}, ["a", "b", "c"])
    two = assign_partitions("run", 16, three, ["a", "c"])
    assert {p for p in range(16) if two[p] != three[p]} == {p for p, r in three.items() if r == "b"}
    four = assign_partitions("run", 16, two, ["a", "c", "d", "e"])
    moved = [p for p in range(16) if four[p] != two[p]]
    assert len(moved) == 8 and {four[p] for p in moved} == {"d", "e"}
