"""The values a checkpoint's manifest and a restore's plan are made of.

``ManifestEntry`` and ``RestoreEntry`` come by the ten thousand, so they are ``NamedTuple``s:
building one costs a single tuple allocation, where a frozen dataclass pays an
``object.__setattr__`` per field, which dominated reading a 16,000-entry manifest back. The
catalog stores them; the planner decides them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from rolloutlog.core._ids import capture_key

__all__ = ["ManifestAction", "ManifestEntry", "PartitionOffset", "RestoreAction", "RestoreEntry"]

ManifestAction = Literal["continue", "restart", "finished"]
RestoreAction = Literal["continue", "restart", "excluded"]


@dataclass(frozen=True, slots=True)
class PartitionOffset:
    """One partition of a checkpoint: its marker offset and where a restore replays it from."""

    partition: int
    marker: int
    replay_from: int | None = None


class ManifestEntry(NamedTuple):
    """One episode of a checkpoint's manifest."""

    episode: str
    attempt: int
    action: ManifestAction
    cut_partition: int
    cut_offset: int
    last_stage: str | None = None
    staging_keys: tuple[str, ...] = ()
    size_bytes: int = 0
    #: Why the episode restarts (``restart`` entries; None otherwise, and in manifests written
    #: before catalog revision 0006).
    reason: str | None = None

    @property
    def capture_key(self) -> str:
        return capture_key(self.episode, self.attempt)


class RestoreEntry(NamedTuple):
    """One episode of a restore plan: its previous and new attempt and what happens to it."""

    episode: str
    previous_attempt: int
    attempt: int
    action: RestoreAction
    reason: str | None = None

    @property
    def capture_key(self) -> str:
        return capture_key(self.episode, self.attempt)
