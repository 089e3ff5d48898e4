"""The trainer client's staging keys composed from replies that say what changed: each
checkpoint's list is its own, read at once or after later checkpoints, and nothing of a
checkpoint whose list is gone is kept."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from rolloutlog.errors import ServiceError
from rolloutlog.trainer import StagingKeyList
from rolloutlog.trainer._types import StagingKeys


def _full(checkpoint_id: int, keys: list[str]) -> dict[str, Any]:
    return {"checkpoint_id": checkpoint_id, "status": "committed", "staging_keys": keys}


def _delta(
    checkpoint_id: int, since: int, added: list[str], removed: list[str], count: int
) -> dict[str, Any]:
    return {
        "checkpoint_id": checkpoint_id,
        "status": "committed",
        "staging_keys_since": since,
        "staging_keys_added": added,
        "staging_keys_removed": removed,
        "staging_key_count": count,
    }


def test_each_checkpoint_lists_its_own_keys_when_read_later() -> None:
    held = StagingKeys()
    first = held.info("run", _full(1, ["a", "b"]))
    second = held.info("run", _delta(2, 1, ["c"], ["b"], 2))
    third = held.info("run", _delta(3, 2, ["b", "d"], ["a"], 3))
    fourth = held.info("run", _delta(4, 3, [], ["c"], 2))
    assert isinstance(second.staging_keys, StagingKeyList)
    # Read newest first: the older lists undo what the later replies changed.
    assert sorted(fourth.staging_keys or ()) == ["b", "d"]
    assert sorted(third.staging_keys or ()) == ["b", "c", "d"]
    assert sorted(second.staging_keys or ()) == ["a", "c"]
    assert sorted(first.staging_keys or ()) == ["a", "b"]
    assert len(second.staging_keys or ()) == 2 and "c" in (second.staging_keys or ())
    assert "b" not in (second.staging_keys or ())
    assert "d" in (fourth.staging_keys or ()) and "a" not in (fourth.staging_keys or ())
    assert held.since("run") == 4


def test_a_list_read_before_the_next_reply_keeps_its_keys() -> None:
    held = StagingKeys()
    held.info("run", _full(1, ["a"]))
    second = held.info("run", _delta(2, 1, ["b"], [], 2))
    assert sorted(second.staging_keys or ()) == ["a", "b"]
    held.info("run", _delta(3, 2, [], ["a", "b"], 0))
    assert second.staging_keys == ("a", "b") or second.staging_keys == ("b", "a")


def test_no_changes_are_kept_once_the_lists_that_need_them_are_gone() -> None:
    held = StagingKeys()
    held.info("run", _full(1, ["k0"]))
    for n in range(2, 50):
        info = held.info("run", _delta(n, n - 1, [f"k{n}"], [f"k{n - 1}"] if n > 2 else [], 2))
        del info
        gc.collect()
    history = held._held["run"][1]
    assert history.changes == {} and len(history.current) == 2
    kept = held.info("run", _delta(50, 49, ["k50"], ["k49"], 2))
    held.info("run", _delta(51, 50, ["k51"], ["k50"], 2))
    assert list(history.changes) == [history.version - 1]  # only what ``kept`` needs undone
    assert sorted(kept.staging_keys or ()) == ["k0", "k50"]


def test_a_count_the_client_cannot_compose_is_refused() -> None:
    held = StagingKeys()
    held.info("run", _full(1, ["a"]))
    with pytest.raises(ServiceError):
        held.info("run", _delta(2, 1, ["b"], [], 3))
    assert held.since("run") is None  # the next request asks for every key
