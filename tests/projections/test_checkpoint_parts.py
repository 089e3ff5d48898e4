"""Checkpoints over replicas, in one process: three coordinators on one log and one
catalog, two folding one of the run's two partitions each (the lease loop's leases, ticked by
hand), one owning none. A checkpoint asked of any commits once both owners' parts are in, and its manifest is the one a single
owner of every partition captures; an owner that never writes its part gets the checkpoint
aborted at its deadline, never committed partial; a requester gone after its markers leaves the
owners to commit it, and one gone before leaves the sweep to abort it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from rolloutlog.catalog import Catalog, ManifestEntry, open_catalog
from rolloutlog.catalog._schema import checkpoint_parts, manifest_parts
from rolloutlog.errors import BackendUnavailable, UnknownCheckpoint
from rolloutlog.log import Event, Log, open_log, partition_for
from rolloutlog.projections import CheckpointResult, Coordinator
from tests import factories as f
from tests.projections.conftest import Service, open_service
from tests.projections.test_ownership import settle

RUN = "run"
#: Two partitions over three replicas: two own one each, one owns none (it still answers).
PARTITIONS = 2
LONG = 60.0  # leases that do not lapse during a test: replicas tick by hand (``settle``)


@dataclass
class Replicas:
    log: Log
    catalog: Catalog
    coordinators: dict[str, Coordinator]
    epoch: int

    async def checkpoint(self, at: str, **kw: Any) -> Any:
        return await self.coordinators[at].checkpoint(RUN, self.epoch, **kw)

    def owning(self) -> list[str]:
        """The replicas that own partitions of the run, by name."""
        return sorted(r for r, c in self.coordinators.items() if c.owned_partitions(RUN))

    def idle(self) -> str:
        [name] = [r for r in self.coordinators if r not in self.owning()]
        return name


@pytest.fixture
async def replicas(tmp_path: Path, deployment: dict[str, Any]) -> AsyncIterator[Replicas]:
    """Three coordinators over one log and catalog, their leases settled by the lease loop."""
    (tmp_path / "replicas").mkdir()
    log = open_log(deployment.get("log_url") or f"embedded://{tmp_path}/replicas")
    await log.start()
    catalog = open_catalog(
        deployment.get("catalog_url") or f"sqlite+aiosqlite:///{tmp_path}/replicas/catalog.db"
    )
    await catalog.start()
    coordinators = {
        r: Coordinator(log, catalog, replica_id=r, lease_s=LONG) for r in ("r1", "r2", "r3")
    }
    try:
        for coordinator in coordinators.values():
            await coordinator.start()
            coordinator._checkpointer.grace_s = 0.3
        await coordinators["r1"].create_run(RUN, PARTITIONS)
        for coordinator in coordinators.values():
            await coordinator.follow(RUN)
        await settle(*coordinators.values())
        epoch = await catalog.take_over_controller(RUN)
        found = Replicas(log, catalog, coordinators, epoch)
        assert len(found.owning()) == 2
        yield found
    finally:
        for coordinator in coordinators.values():
            await coordinator.stop()
        await catalog.stop()
        await log.close()


@pytest.fixture
async def solo(tmp_path: Path, deployment: dict[str, Any]) -> AsyncIterator[Service]:
    """One service owning every partition, fed the same events (in the same kind of log: the
    same offsets): the manifests to expect."""
    (tmp_path / "solo").mkdir()
    log_url = deployment.get("log_url")
    if log_url is not None:
        log_url = log_url.replace("topic_prefix=", "topic_prefix=solo")
    service = await open_service(tmp_path / "solo", PARTITIONS, log_url=log_url)
    try:
        yield service
    finally:
        await service.close()


def episodes_in(partitions: Iterable[int], count: int, prefix: str) -> list[str]:
    """``count`` episode ids that live in each of ``partitions``."""
    found: dict[int, list[str]] = {p: [] for p in partitions}
    i = 0
    while any(len(names) < count for names in found.values()):
        name = f"{prefix}{i}"
        names = found.get(partition_for(name, PARTITIONS))
        if names is not None and len(names) < count:
            names.append(name)
        i += 1
    return [name for names in found.values() for name in names]


def history(episode: str, i: int) -> list[Event]:
    """A continue, a finished, a restart or an open wait step, by ``i``."""
    kind = i % 4
    if kind == 0:
        return [f.started(episode), f.boundary(episode, "seed", {"i": i})]
    if kind == 1:
        return [f.started(episode), f.boundary(episode), f.finished(episode)]
    if kind == 2:
        return [f.started(episode), f.session_started(episode, "s1", "restart_only")]
    return [f.started(episode), f.boundary(episode), f.step_started(episode, "verify", "wait")]


async def append_both(replicas: Replicas, solo: Service, events: list[Event]) -> None:
    await replicas.log.append(RUN, events)
    await solo.append(*events)


def shape(entries: list[ManifestEntry]) -> list[tuple[Any, ...]]:
    return [tuple(entry) for entry in entries]


async def test_a_checkpoint_asked_of_either_replica_commits_the_single_owner_manifest(
    replicas: Replicas, solo: Service
) -> None:
    names = episodes_in(range(PARTITIONS), 4, "e")  # one of each ``history`` per partition
    for i, name in enumerate(names):
        await append_both(replicas, solo, history(name, i))
    waiting = [name for i, name in enumerate(names) if i % 4 == 3]
    first, second = replicas.owning()
    for at, round_ in ((first, 0), (second, 1), (first, 2)):
        if round_:  # the continuing episodes move on, one new per partition
            events = [f.boundary(name, "seed", {"round": round_}) for name in names[::4]]
            events += [
                e for n in episodes_in(range(PARTITIONS), 1, f"n{round_}-") for e in history(n, 0)
            ]
            await append_both(replicas, solo, events)
        # Both answer 202 while a wait step is open, and commit once it closes.
        pending = await replicas.checkpoint(at, wait=False)
        expected_id = await solo.checkpoint(wait=False)
        assert isinstance(pending, int) and isinstance(expected_id, int)
        closing = [f.boundary(name, "verify") for name in waiting]
        if round_ < 2:  # open again for the next round's checkpoint
            closing += [f.step_started(name, "verify", "wait") for name in waiting]
        await append_both(replicas, solo, closing)
        got = await committed_checkpoint(replicas.catalog, pending)
        expected = await committed_checkpoint(solo.catalog, expected_id)
        assert got.counts == expected.counts
        assert got.marked_at is not None  # the requester's, whoever wrote the last part
        assert got.entry_count == expected.entry_count
        assert got.size_bytes == expected.size_bytes
        assert got.offsets == expected.offsets
        assert shape(await replicas.catalog.load_manifest(RUN, pending)) == shape(
            await solo.catalog.load_manifest(RUN, expected_id)
        )
    # A requester that owns no partition sees none of the wait steps: pending (202) all the
    # same, committed once they close.
    await append_both(replicas, solo, [f.step_started(name, "verify", "wait") for name in waiting])
    pending = await replicas.checkpoint(replicas.idle(), wait=False)
    assert isinstance(pending, int)
    assert isinstance(await solo.checkpoint(wait=False), int)  # the logs stay alike
    await append_both(replicas, solo, [f.boundary(name, "verify") for name in waiting])
    assert (await committed_checkpoint(replicas.catalog, pending)).marked_at is not None
    # Answered in full by the requester (no wait step open): counts and staging keys from the
    # catalog, whichever replica's part came last, also by a replica that writes no part.
    for at in (second, first, replicas.idle()):
        result = await replicas.checkpoint(at)
        expected_result = await solo.checkpoint()
        assert isinstance(result, CheckpointResult)
        assert isinstance(expected_result, CheckpointResult)
        assert result.checkpoint.counts == expected_result.checkpoint.counts
        assert sorted(result.staging_keys) == sorted(expected_result.staging_keys)
        assert shape(
            await replicas.catalog.load_manifest(RUN, result.checkpoint.checkpoint_id)
        ) == shape(await solo.catalog.load_manifest(RUN, expected_result.checkpoint.checkpoint_id))


async def committed_checkpoint(catalog: Catalog, checkpoint_id: int) -> Any:
    for _ in range(250):
        checkpoint = await catalog.get_checkpoint(RUN, checkpoint_id)
        if checkpoint.status != "pending":
            assert checkpoint.status == "committed", checkpoint.reason
            return checkpoint
        await asyncio.sleep(0.02)
    raise AssertionError(f"checkpoint {checkpoint_id} still pending")


async def test_an_owner_that_never_writes_gets_the_checkpoint_aborted_at_its_deadline(
    replicas: Replicas,
) -> None:
    names = episodes_in(range(PARTITIONS), 2, "e")
    await replicas.log.append(RUN, [e for i, n in enumerate(names) for e in history(n, i % 3)])
    requester, quiet = replicas.owning()
    silent = await replicas.coordinators[quiet].projector(RUN)
    hook, silent.on_remote_capture = silent.on_remote_capture, None
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match="every partition's part"):
        await replicas.checkpoint(requester, deadline_s=0.5)
    assert 0.5 <= time.monotonic() - started < 5
    [aborted] = await replicas.catalog.list_checkpoints(RUN)
    assert aborted.status == "aborted"
    with pytest.raises(UnknownCheckpoint, match="aborted"):
        await replicas.catalog.load_manifest(RUN, aborted.checkpoint_id)
    async with replicas.catalog._read() as conn:
        for table in (manifest_parts, checkpoint_parts):
            rows = await conn.execute(select(func.count()).select_from(table))
            assert rows.scalar_one() == 0  # the requester's parts went with the abort
    # The owner is back: the next checkpoint commits, whole again on both sides.
    silent.on_remote_capture = hook
    result = await replicas.checkpoint(requester)
    assert isinstance(result, CheckpointResult)
    assert result.checkpoint.entry_count == len(names)


async def test_a_requester_gone_after_its_markers_leaves_the_owners_to_commit(
    replicas: Replicas,
) -> None:
    names = episodes_in(range(PARTITIONS), 2, "e")
    await replicas.log.append(RUN, [e for i, n in enumerate(names) for e in history(n, i % 3)])
    # What a requester does up to its markers, and then nothing (it died).
    checkpoint_id = await replicas.catalog.begin_checkpoint(RUN, replicas.epoch, deadline_s=5)
    await replicas.log.write_markers(RUN, checkpoint_id, replicas.epoch)
    checkpoint = await committed_checkpoint(replicas.catalog, checkpoint_id)
    assert checkpoint.entry_count == len(names)
    # Gone before its markers: nobody can write a part; the sweep aborts it past its deadline
    # and the grace, and the run takes checkpoints again.
    stuck = await replicas.catalog.begin_checkpoint(RUN, replicas.epoch, deadline_s=0.2)
    for _ in range(150):
        if (await replicas.catalog.get_checkpoint(RUN, stuck)).status != "pending":
            break
        await asyncio.sleep(0.02)
    assert (await replicas.catalog.get_checkpoint(RUN, stuck)).status == "aborted"
    assert isinstance(await replicas.checkpoint(replicas.idle()), CheckpointResult)
