"""What the projector keeps per live episode: the fold's state machine without payloads.

``EpisodeTracker`` is ``EpisodeFold`` with ``keep_payloads=False`` — the same rules, keeping sizes,
staging keys and each ledger row's lineage check instead of states and token ids — plus the
partition the projector files it under. Every rule (filters, commit at a boundary, the generation
cut, the verdict, what a restore does to the state) lives in ``_episode`` and ``_verify``; a restore of
a checkpoint this projector captured takes the verdict of every untouched episode from its tracker
(``verdict``) instead of replaying its records.
"""

from __future__ import annotations

from collections.abc import Mapping

from rolloutlog.catalog import ManifestEntry
from rolloutlog.core import EpisodeFold

__all__ = ["EpisodeTracker"]


class EpisodeTracker(EpisodeFold):
    """One live episode as the projector follows it."""

    __slots__ = ("partition",)

    def __init__(self, episode: str, partition: int, attempt: int = 0) -> None:
        super().__init__(episode, attempt, keep_payloads=False)
        self.partition = partition

    def at_cut_of(self, entry: ManifestEntry, versions: Mapping[str, int]) -> bool:
        """Whether this tracker is still, exactly, its state at the cut of the checkpoint whose
        capture decided ``entry`` (a ``continue``) at ``versions``: its fold's state there
        (``exact``), unchanged since (what a restore pins, and what a prepare composes)."""
        return (
            self.exact
            and not self.finished
            and self.attempt == entry.attempt
            and versions.get(entry.episode) == self.version
        )

    def pinned_state(self) -> EpisodeTracker:
        state = super().pinned_state()
        assert isinstance(state, EpisodeTracker)
        return state
