"""A full disk under the embedded deployment, caused for real: the service's
RLIMIT_FSIZE is lowered from outside while it runs (Python ignores SIGXFSZ, so writes past the
limit fail with EFBIG, as on a full disk) and raised again.

Asserts: every append is acknowledged or refused with 503 ``unavailable`` (never 500); refused
appends leave nothing (the log holds exactly the acknowledged records, byte-exact, in order);
appends resume by themselves when space returns; the projector keeps up (checkpoints commit); the
service restarts on the same data.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from rolloutlog.log import Event, partition_for, record_meta
from tests import factories as f
from tests.faults._embedded import Client, LimitedService, as_stored, log_records

RUN = "disk"
PARTITIONS = 2
#: Large enough to go to a blob file (the write that fails part-way).
LARGE = 300 * 1024

pytestmark = pytest.mark.slow


def large_state(episode: str, index: int, epoch: int) -> Event:
    blob = os.urandom(LARGE // 2).hex()
    who = f.participant(epoch=epoch)
    return f.session_state(episode, state={"index": index, "blob": blob}, who=who)


async def test_full_disk_refuses_appends_cleanly_and_recovers(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    service = LimitedService(data_dir, tmp_path)
    await service.start()
    client = Client(service.url)
    acked: list[Event] = []
    refused: list[Event] = []
    index = 0

    async def append(*events: Event) -> int:
        reply = await client.append(RUN, events)
        assert reply.status_code in (200, 503), reply.text
        if reply.status_code == 503:
            assert reply.json()["error"]["code"] == "unavailable"
            refused.extend(events)
        else:
            acked.extend(events)
        return reply.status_code

    try:
        await client.create_run(RUN, PARTITIONS)
        epoch = await client.register(RUN)
        controller = await client.take_over(RUN)
        who = f.participant(epoch=epoch)
        episodes = [f"e{i}" for i in range(4)]
        for episode in episodes:
            assert await append(f.started(episode, who=who)) == 200
        for _ in range(3):
            index += 1
            assert await append(large_state(episodes[index % 4], index, epoch)) == 200

        # The disk fills: no file of the service may grow past 64 KiB beyond the blob file.
        blob_dir = data_dir / "log" / f"{RUN}.blobs"
        blob_size = max(p.stat().st_size for p in blob_dir.iterdir())
        service.set_limit(resource.RLIMIT_FSIZE, blob_size + 64 * 1024)
        statuses = []
        for _ in range(6):
            index += 1
            statuses.append(await append(large_state(episodes[index % 4], index, epoch)))
            small = f.boundary(episodes[index % 4], "seed", {"turn": index}, who=who)
            statuses.append(await append(small))
        assert 503 in statuses, "the limit did not bite"
        # No file may grow at all (the catalog neither): a checkpoint commits or is refused (503),
        # never a 500, and leaves no pending checkpoint behind (the one after recovery commits).
        service.set_limit(resource.RLIMIT_FSIZE, 0)
        refused_checkpoint = await client.call(
            "POST",
            f"/v1/runs/{RUN}/checkpoints",
            "trainer",
            json={"controller_epoch": controller, "wait": True},
        )
        assert refused_checkpoint.status_code in (201, 503), refused_checkpoint.text
        assert service.proc is not None and service.proc.poll() is None, service.tail()

        # Space returns: appends go through again, without a restart.
        service.set_limit(resource.RLIMIT_FSIZE, resource.RLIM_INFINITY)
        for _ in range(3):
            index += 1
            assert await append(large_state(episodes[index % 4], index, epoch)) == 200
            small = f.boundary(episodes[index % 4], "seed", {"turn": index}, who=who)
            assert await append(small) == 200
        # The projector read every record (a checkpoint commits only past all of them).
        assert (await client.checkpoint(RUN, controller, wait=True))["status"] == "committed"

        # A restart on the same data (SIGKILL: nothing gets to tidy up).
        service.kill()
        await service.start()
        assert (await client.checkpoint(RUN, controller, wait=True))["status"] == "committed"
        service.stop()
    finally:
        await client.aclose()
        service.stop()

    # Exactly the acknowledged records, in order per partition, byte-exact.
    expected: dict[int, list[bytes]] = {p: [] for p in range(PARTITIONS)}
    for event in acked:
        assert event.episode is not None
        expected[partition_for(event.episode, PARTITIONS)].append(as_stored(event))
    stored = await log_records(data_dir, RUN)
    for partition in range(PARTITIONS):
        records = [r for r in stored[partition] if record_meta(r)["type"] != "checkpoint.marker"]
        assert records == expected[partition], f"partition {partition}"
    assert refused, "nothing was refused"
