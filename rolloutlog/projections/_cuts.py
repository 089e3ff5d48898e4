"""What a restore did with each generation cut (docs/design.md §4): counted per restore for the
``rolloutlog_generation_cuts_total{disposition}`` metric.

- ``continued``: the replacement policy call continues the cut's durable token prefix;
- ``terminal``: the cut's call had completed (nothing is left to generate);
- ``dropped_by_policy``: the restore's policy rule (``apply_policy``) dropped it, the call
  regenerates;
- ``restart_invalid``: the cut did not check out (``generation_cut_problem``), so its episode
  restarts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from rolloutlog.projections._model import EpisodeProjection, GenerationCut
from rolloutlog.projections._planner import PinnedCut, RestorePlan

__all__ = ["CUT_DISPOSITIONS", "cut_dispositions"]

#: What a restore can do with a generation cut (the metric's ``disposition`` label).
CUT_DISPOSITIONS = ("continued", "terminal", "dropped_by_policy", "restart_invalid")

#: How ``generation_cut_problem`` begins the reason of a restart it causes.
_CUT_PROBLEM = "generation cut of call "


def cut_dispositions(
    plan: RestorePlan,
    replayed: Mapping[str, EpisodeProjection],
    pinned: Mapping[str, PinnedCut],
) -> dict[str, int]:
    """Disposition → count over the plan's episodes (those without a cut are not counted)."""
    counts: Counter[str] = Counter()
    for planned in plan.episodes:
        entry = planned.entry
        if entry.action == "restart":
            if entry.reason is not None and entry.reason.startswith(_CUT_PROBLEM):
                counts["restart_invalid"] += 1
            continue
        if entry.action != "continue":
            continue
        cut: GenerationCut | None
        if planned.from_pin:
            # The projector's trackers are folds: they have the cut (``CutState`` names only
            # the verdict).
            of_state = getattr(pinned[entry.episode].pinned_state(), "generation_cut", None)
            cut = of_state() if of_state is not None else None
        else:
            cut = planned.projection.generation_cut if planned.projection is not None else None
            before = replayed.get(entry.episode)
            if cut is None and before is not None and before.generation_cut is not None:
                counts["dropped_by_policy"] += 1
                continue
        if cut is not None:
            counts["terminal" if cut.terminal else "continued"] += 1
    return dict(counts)
