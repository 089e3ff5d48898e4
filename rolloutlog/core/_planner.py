"""The restore planner: which episode continues, restarts or is excluded, and why. Pure: no log,
no catalog, no clock; the restore runner (``_restorer.py``) gathers its inputs and carries the plan
out (docs/design.md §6 and §10, "A restore").

The rule, per episode of the checkpoint's manifest (in the manifest's order):

- named in ``exclude`` → ``excluded`` (whatever its action), reason ``EXCLUDED_BY_TRAINER``;
- ``finished`` in the manifest → not in the plan (reported by the checkpoint already);
- ``restart`` in the manifest → ``restart`` with the manifest's reason (its cause, recorded by the
  checkpoint; manifests from before catalog revision 0006 have none: ``MANIFEST_SAYS_RESTART``);
- ``continue`` → its state at the cut (a pinned tracker's verdict, else the replayed projection,
  verified and put through the policy rule) decides: ``continue`` at its cut, or ``restart`` with
  the reason it cannot continue.

Then every episode begun after the checkpoint's markers (not in the manifest; its events belong to
the timeline the restore abandons), in id order: ``excluded`` if named, else ``restart``. Every
planned episode moves to its next attempt: one past the current one (the catalog's, else the
manifest's or the tracker's).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rolloutlog.core._model import BoundaryView, EpisodeProjection, SessionView
from rolloutlog.core._values import ManifestEntry, PartitionOffset, RestoreEntry
from rolloutlog.core._verify import apply_policy, verify_projection
from rolloutlog.errors import UnknownEpisode

__all__ = [
    "EXCLUDED_BY_TRAINER",
    "MANIFEST_SAYS_RESTART",
    "NO_EVENTS_BEFORE_CUT",
    "CutState",
    "PinnedCut",
    "PlannedEpisode",
    "RestorePlan",
    "RestorePolicy",
    "begun_after_reason",
    "check_exclusions",
    "not_exported_reason",
    "plan_restore",
    "replay_start",
    "restart_only_reason",
    "to_continue",
    "wait_expired_reason",
]

MANIFEST_SAYS_RESTART = "the checkpoint's manifest says restart"
NO_EVENTS_BEFORE_CUT = "no events before the cut"
EXCLUDED_BY_TRAINER = "excluded by the trainer (named in the restore request's exclude)"


# -- reasons: each names its cause (which step, session, server, deadline) --------------------


def begun_after_reason(checkpoint_id: int) -> str:
    return f"began after the markers of checkpoint {checkpoint_id}"


def restart_only_reason(sessions: Mapping[str, SessionView]) -> str:
    """Why an episode with open ``restart_only`` sessions at its cut restarts: which sessions of
    which participants (an agent's is one without session hooks)."""
    named = [
        f"session {s.session_id} of {_who(s)}"
        for s in sessions.values()
        if s.mode == "restart_only"
    ]
    return f"restart-only {', '.join(named) or 'session'} open at the cut"


def wait_expired_reason(
    owners: Iterable[str],
    boundaries: Mapping[str, BoundaryView],
    sessions: Mapping[str, SessionView],
    deadline_s: float,
) -> str:
    """Why an episode whose wait steps were still open at the checkpoint's deadline restarts:
    each open step by stage and owner; a ``verify`` step names the resources servers it runs on."""
    parts = []
    for owner in sorted(owners):
        boundary = boundaries.get(owner)
        stage = (
            boundary.next if boundary is not None else "seed" if owner == "environment" else None
        )
        if stage is None:
            parts.append(f"wait step of {owner}")
        elif stage == "verify":
            servers = sorted({s.participant for s in sessions.values() if s.kind == "resources"})
            where = f"resources server {', '.join(servers)}" if servers else "its resources server"
            parts.append(f"verify step of {where}")
        elif owner == "environment":
            parts.append(f"{stage} step of the environment")
        else:
            parts.append(f"{stage} step of {owner}")
    return f"{' and '.join(parts) or 'a wait step'} still open at the {deadline_s:g} s deadline"


def not_exported_reason(session_ids: Iterable[str], checkpoint_id: int) -> str:
    """Why an episode with export-on-checkpoint sessions restarts: not exported in time."""
    named = ", ".join(sorted(session_ids))
    return f"session {named} not exported by checkpoint {checkpoint_id}'s deadline"


def _who(session: SessionView) -> str:
    if session.kind == "agent":
        return f"agent {session.participant} (an agent without session hooks)"
    return f"{session.kind} server {session.participant}"


class CutState(Protocol):
    """An episode's state at its cut kept by the projector (a pinned tracker): its verdict is
    ``verify_projection``'s on the projection it stands for."""

    def verdict(self) -> str | None: ...


class PinnedCut(Protocol):
    """A pinned tracker (``Projector.pin_cut_states``): its state as it was at the cut."""

    def pinned_state(self) -> CutState: ...


@dataclass(frozen=True, slots=True)
class RestorePolicy:
    """The request's policy rule (``apply_policy``): none when ``policy_version`` is None."""

    policy_version: int | None = None
    max_policy_lag: int | None = None

    @property
    def constrains(self) -> bool:
        """A policy changes projections, so a restore under one replays every episode."""
        return self.policy_version is not None


@dataclass(slots=True)
class PlannedEpisode:
    """What the restore does to one episode, beyond its plan entry: where it continues from."""

    entry: RestoreEntry
    #: The cut offset an ``attempt.started`` names (0 for restart and excluded).
    cut: int = 0
    #: For ``continue``: the projection it continues from (replayed), or None when it continues
    #: from its pinned tracker (``from_pin``).
    projection: EpisodeProjection | None = None
    from_pin: bool = False


@dataclass(slots=True)
class RestorePlan:
    """The plan: one entry per planned episode, in plan order, and its continued projections."""

    episodes: list[PlannedEpisode] = field(default_factory=list)
    #: The replayed projections of the continued episodes (for the restore's projection cache).
    projections: dict[str, EpisodeProjection] = field(default_factory=dict)

    @property
    def entries(self) -> tuple[RestoreEntry, ...]:
        return tuple(planned.entry for planned in self.episodes)


def replay_start(offsets: Iterable[PartitionOffset]) -> dict[int, int]:
    """Per partition, where a replay of the checkpoint starts: its ``replay_from`` (the earliest
    offset a live episode needs), or its marker for a checkpoint that recorded none."""
    return {o.partition: o.replay_from if o.replay_from is not None else o.marker for o in offsets}


def check_exclusions(
    checkpoint_id: int,
    exclude: Collection[str],
    known: Collection[str],
    begun_after: Collection[str],
) -> None:
    """``UnknownEpisode`` for excluded episodes neither in the manifest nor begun after it."""
    unknown = sorted(e for e in exclude if e not in known and e not in begun_after)
    if unknown:
        raise UnknownEpisode(
            f"{len(unknown)} excluded episode(s) are not in checkpoint "
            f"{checkpoint_id}: {unknown[:5]}",
            episodes=unknown[:100],
        )


def to_continue(manifest: Iterable[ManifestEntry], exclude: Collection[str]) -> list[ManifestEntry]:
    """The manifest's ``continue`` entries the request does not exclude: those whose state at the
    cut the plan needs (pinned or replayed)."""
    return [e for e in manifest if e.action == "continue" and e.episode not in exclude]


def plan_restore(
    checkpoint_id: int,
    manifest: Sequence[ManifestEntry],
    *,
    current: Mapping[str, int],
    begun_after: Mapping[str, int],
    exclude: Collection[str] = frozenset(),
    pinned: Mapping[str, PinnedCut] | None = None,
    projections: Mapping[str, EpisodeProjection] | None = None,
    policy: RestorePolicy = RestorePolicy(),
) -> RestorePlan:
    """The restore plan of a committed checkpoint (see the module's docstring for the rule).

    ``current``: the catalog's current attempt per episode; ``begun_after``: the episodes begun
    after the markers, with their current attempt; ``pinned``: trackers pinned at the cut (their
    verdict stands for a replay; never under a policy); ``projections``: the replayed
    projections of the other ``continue`` entries (an entry with neither has no events before
    its cut). ``UnknownEpisode`` when ``exclude`` names an episode of neither kind.
    """
    if exclude:
        check_exclusions(checkpoint_id, exclude, {entry.episode for entry in manifest}, begun_after)
    pins = pinned or {}
    replayed = projections or {}
    plan = RestorePlan()
    episodes, kept = plan.episodes, plan.projections
    policy_version, max_policy_lag = policy.policy_version, policy.max_policy_lag
    for entry in manifest:
        episode = entry.episode
        previous = current.get(episode, entry.attempt)
        if episode in exclude:
            episodes.append(_excluded(episode, previous))
            continue
        action = entry.action
        if action == "finished":
            continue
        if action == "restart":
            episodes.append(_restart(episode, previous, entry.reason or MANIFEST_SAYS_RESTART))
            continue
        tracker = pins.get(episode)
        if tracker is not None:
            reason = tracker.pinned_state().verdict()
            if reason is None:
                episodes.append(_continue(episode, previous, entry.cut_offset, from_pin=True))
            else:
                episodes.append(_restart(episode, previous, reason))
            continue
        projection = replayed.get(episode)
        if projection is None:
            reason = NO_EVENTS_BEFORE_CUT
        else:
            reason = verify_projection(projection)
            if reason is None:
                projection, reason = apply_policy(projection, policy_version, max_policy_lag)
        if reason is None and projection is not None:
            kept[episode] = projection
            episodes.append(_continue(episode, previous, entry.cut_offset, projection=projection))
        else:
            episodes.append(_restart(episode, previous, reason))
    after_markers = begun_after_reason(checkpoint_id)
    for episode in sorted(begun_after):
        previous = current.get(episode, begun_after[episode])
        if episode in exclude:
            episodes.append(_excluded(episode, previous))
        else:
            episodes.append(_restart(episode, previous, after_markers))
    return plan


def _continue(
    episode: str,
    previous: int,
    cut: int,
    *,
    projection: EpisodeProjection | None = None,
    from_pin: bool = False,
) -> PlannedEpisode:
    """``episode`` continues from ``cut`` as its next attempt: from its replayed
    ``projection``, or from its pinned tracker (``from_pin``)."""
    entry = RestoreEntry(episode, previous, previous + 1, "continue")
    return PlannedEpisode(entry, cut, projection=projection, from_pin=from_pin)


def _excluded(episode: str, previous: int) -> PlannedEpisode:
    entry = RestoreEntry(episode, previous, previous + 1, "excluded", EXCLUDED_BY_TRAINER)
    return PlannedEpisode(entry)


def _restart(episode: str, previous: int, reason: str | None) -> PlannedEpisode:
    return PlannedEpisode(RestoreEntry(episode, previous, previous + 1, "restart", reason))
