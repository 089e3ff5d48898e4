"""The fold's record filters (docs/design.md §5; rules 3-5 of ``projections._fold``): a zombie's
records, duplicates, and the records of any attempt but the current one are not applied."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EventFilters"]

intern = sys.intern


@dataclass(slots=True, init=False)
class EventFilters:
    """Per-episode state of the zombie, duplicate and attempt filters (rules 3-5)."""

    #: The attempt whose records are admitted (a committed restore's ``attempt.started`` moves
    #: it on: ``rolloutlog.core._restore``).
    current_attempt: int = 0
    #: Per participant id, its highest epoch and the last seq admitted from that epoch: a record
    #: of an older epoch is a zombie's, a seq at or below the last a duplicate. (An older epoch's
    #: seqs are never asked again, so one entry per participant is enough: ~350 bytes an episode
    #: less than a dict of epochs beside a dict of seqs keyed by (id, epoch).)
    seen: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __init__(
        self,
        current_attempt: int = 0,
        seen: dict[str, tuple[int, int]] | None = None,
        *,
        attempt: int | None = None,
    ) -> None:
        self.current_attempt = current_attempt if attempt is None else attempt
        self.seen = {} if seen is None else seen

    @property
    def attempt(self) -> int:
        """The former name of ``current_attempt``."""
        return self.current_attempt

    @attempt.setter
    def attempt(self, value: int) -> None:
        self.current_attempt = value

    def admits(self, meta: dict[str, Any]) -> bool:
        who = meta["participant"]
        pid, epoch = who["id"], who["epoch"]
        seq = meta["seq"]
        seen = self.seen
        last = seen.get(pid)
        if last is None:
            # Interned: the same few participants write every episode of a run.
            seen[intern(pid)] = (epoch, seq)
        elif last[0] < epoch or (last[0] == epoch and seq > last[1]):
            seen[pid] = (epoch, seq)
        else:
            return False
        attempt: int = meta["attempt"]
        return attempt == self.current_attempt

    def last_seq(self, participant: tuple[str, int]) -> int | None:
        """The last seq admitted from a participant epoch, or None."""
        last = self.seen.get(participant[0])
        return last[1] if last is not None and last[0] == participant[1] else None

    @classmethod
    def after(
        cls, records: Iterable[tuple[int, dict[str, Any], Any]], current_attempt: int
    ) -> EventFilters:
        """The filters after a whole history (so that later zombies and duplicates stay
        filtered), with ``current_attempt`` current."""
        filters = cls()
        for _, meta, _ in records:
            if meta["type"] not in ("attempt.started", "checkpoint.marker"):
                filters.admits(meta)
        filters.current_attempt = current_attempt
        return filters
