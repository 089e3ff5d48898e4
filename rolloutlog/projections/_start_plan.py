"""Where a run's projector starts: the catalog's latest checkpoint and restores, and a check
that the log still holds what the catalog names (a run whose log lost records is ``RunLost``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rolloutlog.catalog import FORK_RESTORE_ID, Catalog, Restore, inherited_restore
from rolloutlog.core import replay_start
from rolloutlog.errors import RunLost, UnknownRun
from rolloutlog.log import Log

__all__ = ["StartPlan", "all_restores", "start_plan"]


@dataclass(frozen=True, slots=True)
class StartPlan:
    """Where a projector starts and what the catalog says about what it will read."""

    start_offsets: list[int]
    committed_restores: Iterable[int] = ()
    retired: Iterable[str] = ()
    #: Episodes a committed restore continued or restarted, with the attempt it made current:
    #: their trackers are rebuilt from their records with the fold's selection (the cut
    #: truncation needs their history; a restarted one's records may start after its restore).
    refold: Mapping[str, int] = field(default_factory=dict)
    #: The latest committed checkpoint's markers: an episode that finished below its partition's
    #: marker was reported by that checkpoint or an earlier one, and is not tracked again.
    reported_below: Sequence[int] | None = None
    #: Positions (partition, offset) the catalog has quarantined already.
    quarantined: Iterable[tuple[int, int]] = ()
    #: Restores still being planned by the partitions' owners: their verdict is
    #: pending, so their ``attempt.started`` records wait for it (``end_restore``).
    planning_restores: Iterable[int] = ()
    #: The first checkpoint id not over when the plan was made (the pending one's, else the
    #: next): catching up stops short of such a checkpoint's markers, so that they are met
    #: caught up and captured (None: catching up reads to the log's end).
    open_checkpoints_from: int | None = None


async def start_plan(log: Log, catalog: Catalog, run: str) -> StartPlan:
    """Where the run's projector starts, from the catalog; checks that the log still holds
    what the catalog names (``RunLost`` otherwise)."""
    summary = await catalog.run_summary(run)
    info = summary.run
    history = (
        info.latest_checkpoint_id is not None
        or summary.checkpoint_counts
        or summary.participant_count
        or summary.episode_count
        or summary.restore_count
    )
    if history:
        # An existing run is never re-created in the log: a missing topic means it was lost.
        try:
            partitions = await log.partitions(run)
        except UnknownRun as e:
            raise RunLost(
                f"run {run!r} has no log topic any more, but the catalog holds its history "
                "(checkpoints, participants or episodes): the log lost its records (a broker "
                "restarted empty, or the topic was deleted). Appends are refused; delete the "
                "run, or restore its topic and restart the service",
                run=run,
            ) from e
    else:
        partitions = await log.ensure_run(run, info.partitions)
    start = [0] * partitions
    markers: list[int] | None = None
    if info.latest_checkpoint_id is not None:
        latest = await catalog.get_checkpoint(run, info.latest_checkpoint_id)
        markers = [0] * partitions
        for offset in latest.offsets:
            markers[offset.partition] = offset.marker
        for partition, replay_from in replay_start(latest.offsets).items():
            start[partition] = replay_from
        await _check_log_holds(log, run, latest.checkpoint_id, markers)
    # Restores still planned by the partitions' owners: their verdict is pending. Read before
    # the committed ones, so that a request committing in between is in both (committed wins).
    planning = await catalog.planning_restores(run)
    restores = await all_restores(catalog, run)
    restored: dict[str, int] = {}  # episode -> the attempt its latest restore made current
    retired: set[str] = set()
    for restore in sorted(restores, key=lambda r: r.restore_id):
        if restore.restore_id == FORK_RESTORE_ID:
            continue  # a fork's inherited restore: its records need no refold of their own
        for entry in await catalog.restore_episodes(run, restore.restore_id, limit=None):
            if entry.action == "excluded":
                retired.add(entry.episode)
            else:  # their records need the restore's truncation
                restored[entry.episode] = entry.attempt
    quarantined = await catalog.quarantined(run, limit=None)
    committed = {r.restore_id for r in restores}
    newest = await catalog.list_checkpoints(run, limit=1)
    open_from = (
        1 if not newest else newest[0].checkpoint_id + (0 if newest[0].status == "pending" else 1)
    )
    return StartPlan(
        start,
        committed_restores=[r.restore_id for r in restores],
        retired=retired,
        refold={e: a for e, a in restored.items() if e not in retired},
        reported_below=markers,
        quarantined=[(q.partition, q.offset) for q in quarantined],
        planning_restores=[r.restore_id for r in planning if r.restore_id not in committed],
        open_checkpoints_from=open_from,
    )


async def _check_log_holds(log: Log, run: str, checkpoint_id: int, markers: list[int]) -> None:
    # What the broker holds, every writer's records included (``end_offsets`` counts only this
    # instance's own writes to a partition it wrote: another replica may have written since).
    ends = await log.latest_offsets(run)
    short = [
        (partition, end, marker)
        for partition, (end, marker) in enumerate(zip(ends, markers, strict=False))
        if end < marker + 1
    ]
    if len(ends) < len(markers) or short:
        where = ", ".join(f"partition {p} ends at {e}, marker at {m}" for p, e, m in short[:4])
        raise RunLost(
            f"the log of run {run!r} no longer holds the records its committed checkpoint "
            f"{checkpoint_id} names ({where or 'fewer partitions'}): it lost records (a broker "
            "restarted empty, or the topic was recreated). Appends are refused: they would "
            "land at offsets the checkpoint names. Delete the run, or restore its topic and "
            "restart the service",
            run=run,
            checkpoint_id=checkpoint_id,
        )


async def all_restores(catalog: Catalog, run: str) -> list[Restore]:
    """The run's committed restores; a fork's include the restore its copied records name
    (``inherited_restore``)."""
    out: list[Restore] = []
    before: int | None = None
    while True:
        page = await catalog.list_restores(run, before=before, limit=500)
        out.extend(page)
        if len(page) < 500:
            break
        before = page[-1].restore_id
    inherited = inherited_restore(await catalog.get_run(run))
    return out if inherited is None else [*out, inherited]
