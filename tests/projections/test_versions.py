"""A checkpoint's entries' versions laid over the previous checkpoint's (``Versions``): each
checkpoint's map reads as the copy it replaced would, however many checkpoints followed it."""

from __future__ import annotations

import random

from rolloutlog.projections._capture import _VERSIONS_DEPTH, Versions


def test_each_checkpoint_reads_as_its_own_copy() -> None:
    rng = random.Random(7)
    copies: list[dict[str, int]] = [{f"e{i}": 0 for i in range(200)}]
    layered: list[Versions | dict[str, int]] = [dict(copies[0])]
    for n in range(1, 3 * _VERSIONS_DEPTH + 2):
        changes: dict[str, int | None] = {}
        for _ in range(rng.randrange(0, 30)):
            episode = f"e{rng.randrange(260)}"
            changes[episode] = None if rng.random() < 0.3 else n
        copy = dict(copies[-1])
        for episode, version in changes.items():
            if version is None:
                copy.pop(episode, None)
            else:
                copy[episode] = version
        copies.append(copy)
        layered.append(Versions.over(layered[-1], changes))
        # Every earlier checkpoint's map still reads as it did (a restore may pin any).
        for old, want in zip(layered, copies, strict=True):
            for i in range(260):
                assert old.get(f"e{i}") == want.get(f"e{i}")
    last = layered[-1]
    assert isinstance(last, Versions)
    assert dict(last.items()) == copies[-1] and len(last) == len(copies[-1])
    assert last._depth <= _VERSIONS_DEPTH  # flattened now and then, not an endless chain


def test_a_removed_episode_is_absent_and_can_come_back() -> None:
    first = Versions.over({"a": 1, "b": 1}, {"a": None})
    assert first.get("a") is None and "a" not in first and first["b"] == 1
    second = Versions.over(first, {"a": 3})
    assert second.get("a") == 3 and first.get("a") is None
