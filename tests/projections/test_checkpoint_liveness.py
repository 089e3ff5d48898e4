"""Checkpoints that survive what they can, in one process (three coordinators on one log and one
catalog, the leases ticked by hand; the multi-process cases are ``tests/e2e/
test_replica_liveness.py``): a checkpoint whose partitions change owner while it is pending
commits within its deadline (their new owners' projectors, started afresh, meet the markers
caught up); a pending checkpoint whose requester's lease lapsed is superseded by the next
request at once; a checkpoint aborted by a controller take-over answers ``stale_controller``
as soon as the next one begins, never ``unavailable`` at its deadline."""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import update

from rolloutlog.catalog._schema import replicas as replicas_table
from rolloutlog.errors import BackendUnavailable, StaleController
from rolloutlog.projections import CheckpointResult
from tests import factories as f
from tests.projections.test_checkpoint_parts import (
    RUN,
    Replicas,
    committed_checkpoint,
    episodes_in,
    history,
    replicas,
)
from tests.projections.test_ownership import settle

__all__ = ["replicas"]  # the fixture, used by name


async def test_an_owner_gone_mid_checkpoint_is_taken_over_within_the_deadline(
    replicas: Replicas,
) -> None:
    """An owner stops before writing its part (its leases released: taken over at the next
    tick); the survivors' projectors restart for their new partitions, rebuilt from the log,
    and capture the pending checkpoint's markers: the requester's answer is committed."""
    names = episodes_in(range(2), 3, "e")
    await replicas.log.append(RUN, [e for i, n in enumerate(names) for e in history(n, i % 3)])
    requester, quiet = replicas.owning()
    silent = await replicas.coordinators[quiet].projector(RUN)
    silent.on_remote_capture = None  # it never writes its part
    request = asyncio.create_task(replicas.checkpoint(requester, deadline_s=8))
    for _ in range(400):
        if await _written(replicas):
            break
        await asyncio.sleep(0.02)
    started = time.monotonic()
    await replicas.coordinators.pop(quiet).stop()
    await settle(*replicas.coordinators.values())
    result = await request
    assert isinstance(result, CheckpointResult)
    assert result.checkpoint.status == "committed"
    assert result.checkpoint.entry_count == len(names)
    assert time.monotonic() - started < 8
    manifest = await replicas.catalog.load_manifest(RUN, result.checkpoint.checkpoint_id)
    assert {entry.episode for entry in manifest} == set(names)
    # And the next one commits through either survivor.
    for name in replicas.coordinators:
        assert isinstance(await replicas.checkpoint(name), CheckpointResult)


async def test_the_marker_of_a_pending_checkpoint_met_while_catching_up_is_captured(
    replicas: Replicas,
) -> None:
    """A checkpoint pending when an owner's projector (re)starts, its markers in the log it
    catches up with: the projector stops short of them, then captures them caught up."""
    names = episodes_in(range(2), 3, "e")
    await replicas.log.append(RUN, [e for i, n in enumerate(names) for e in history(n, i % 3)])
    first, second = replicas.owning()
    # Their projectors do not take part: a requester that died after its markers, and owners
    # that start afresh after them.
    for name in (first, second):
        (await replicas.coordinators[name].projector(RUN)).on_remote_capture = None
    checkpoint_id = await replicas.catalog.begin_checkpoint(RUN, replicas.epoch, deadline_s=8)
    await replicas.log.write_markers(RUN, checkpoint_id, replicas.epoch)
    await replicas.log.append(
        RUN, [e for n in episodes_in(range(2), 1, "late") for e in history(n, 0)]
    )
    started = time.monotonic()
    for name in (first, second):  # a new projector each: as after an owner change
        coordinator = replicas.coordinators[name]
        old = coordinator.projectors[RUN]
        await old.stop()
        await coordinator._launch(RUN)
    checkpoint = await committed_checkpoint(replicas.catalog, checkpoint_id)
    assert time.monotonic() - started < 8
    assert checkpoint.entry_count == len(names)  # the late ones came after the markers


async def test_a_lapsed_requesters_checkpoint_is_superseded_at_once(replicas: Replicas) -> None:
    """The requester's heartbeat lapsed (killed, or paused past its lease) with its checkpoint
    pending on an open wait step: the next request, through another replica, supersedes it."""
    names = episodes_in(range(2), 4, "e")
    await replicas.log.append(RUN, [e for i, n in enumerate(names) for e in history(n, i)])
    requester, other = replicas.owning()
    waiting = asyncio.create_task(replicas.checkpoint(requester, deadline_s=30))
    for _ in range(500):
        if found := await replicas.catalog.list_checkpoints(RUN, status="pending"):
            break
        await asyncio.sleep(0.02)
    pending = found[0].checkpoint_id
    async with replicas.catalog._write() as conn:
        await conn.execute(
            update(replicas_table)
            .where(replicas_table.c.replica_id == requester)
            .values(expires_at=0.0)
        )
    # The other replica's part is written when its wait step expires, at the deadline: the
    # requester waits a grace for it past the deadline. The fixture's 0.3 s was too short on a
    # loaded machine (a full test run on 2 cores: the part came later, the checkpoint
    # committed, the request failed); 2 s still keeps this far from the orphan's 30 s.
    for coordinator in replicas.coordinators.values():
        coordinator._checkpointer.grace_s = 2.0
    started = time.monotonic()
    result = await replicas.checkpoint(other, deadline_s=0.5)
    assert isinstance(result, CheckpointResult)
    assert result.checkpoint.checkpoint_id == pending + 1
    assert time.monotonic() - started < 5  # not the orphan's 30 s deadline
    orphan = await replicas.catalog.get_checkpoint(RUN, pending)
    assert orphan.status == "aborted"
    assert orphan.reason is not None and "superseded" in orphan.reason
    # Its requester (alive after all: a stall) hears why, retriable, once the next one began.
    with pytest.raises(BackendUnavailable, match="superseded"):
        await waiting


async def test_a_checkpoint_aborted_by_a_take_over_answers_stale_controller(
    replicas: Replicas,
) -> None:
    names = episodes_in(range(2), 4, "e")
    await replicas.log.append(RUN, [e for i, n in enumerate(names) for e in history(n, i)])
    first, second = replicas.owning()
    old = asyncio.create_task(replicas.checkpoint(first, deadline_s=30))  # a wait step holds it
    for _ in range(500):
        if await replicas.catalog.list_checkpoints(RUN, status="pending"):
            break
        await asyncio.sleep(0.02)
    started = time.monotonic()
    epoch = await replicas.catalog.take_over_controller(RUN)
    new = await replicas.coordinators[second].checkpoint(RUN, epoch, deadline_s=0.5)
    assert isinstance(new, CheckpointResult)
    with pytest.raises(StaleController):
        await old
    assert time.monotonic() - started < 10  # not its 30 s deadline


async def _written(replicas: Replicas) -> bool:
    [pending] = await replicas.catalog.list_checkpoints(RUN, status="pending") or [None]
    if pending is None:
        return False
    return bool(await replicas.catalog.written_parts(RUN, pending.checkpoint_id))


async def test_a_requester_whose_projector_is_replaced_while_it_waits_answers_the_commit(
    replicas: Replicas,
) -> None:
    """Wait steps hold the checkpoint; meanwhile the requester's projector is replaced (as when
    its partitions change owner): the new projector captures the markers caught up and settles
    the waits when their boundaries come, and the requester answers that commit at once, with
    the waited episodes continued (not restarted at the deadline)."""
    names = episodes_in(range(2), 4, "e")
    await replicas.log.append(RUN, [e for i, n in enumerate(names) for e in history(n, i)])
    waiting = [name for i, name in enumerate(names) if i % 4 == 3]
    requester, _ = replicas.owning()
    coordinator = replicas.coordinators[requester]
    request = asyncio.create_task(replicas.checkpoint(requester, deadline_s=20))
    old = await coordinator.projector(RUN)
    for _ in range(500):
        capture = old._capture
        if capture is not None and capture.reached.is_set():
            break
        await asyncio.sleep(0.02)
    started = time.monotonic()
    await old.stop()
    await coordinator._launch(RUN)
    await asyncio.sleep(0.3)
    await replicas.log.append(RUN, [f.boundary(name, "verify") for name in waiting])
    result = await request
    assert time.monotonic() - started < 10  # not the 20 s deadline
    assert isinstance(result, CheckpointResult)
    manifest = await replicas.catalog.load_manifest(RUN, result.checkpoint.checkpoint_id)
    actions = {entry.episode: entry.action for entry in manifest}
    assert {actions[name] for name in waiting} == {"continue"}, actions
