"""The projector's and the coordinator's shortcuts give the answers of the long way round."""

from __future__ import annotations

import orjson

from rolloutlog.log import encode_record
from rolloutlog.log._codec import record_restore_id
from rolloutlog.projections import CheckpointResult
from tests import factories as f
from tests.projections.conftest import Service


def test_restore_ids_are_read_off_the_service_records_only() -> None:
    meta = {
        "v": 1,
        "episode": "r1",
        "attempt": 2,
        "step": None,
        "participant": {"id": "rolloutlog", "kind": "service", "epoch": 3},
        "seq": 1,
        "ts": 1.0,
        "type": "attempt.started",
        "data": {"restore_id": 417, "checkpoint_id": 9, "previous_attempt": 1, "cut": 12},
    }
    assert record_restore_id(orjson.dumps(meta)) == 417
    # Other records, including one whose payload spells the same bytes, are not restores.
    assert record_restore_id(encode_record(f.started("r1"))) is None
    state = {"type": "attempt.started", "data": {"restore_id": 5, "cut": 1}}
    assert record_restore_id(encode_record(f.boundary("r1", "seed", state))) is None


async def test_a_restores_own_records_are_skipped_yet_fence_and_continue(
    service: Service,
) -> None:
    await service.append(f.started("a"), f.boundary("a", "seed", {"t": 1}))
    await service.append(f.started("b"), f.boundary("b", "seed", {"t": 2}))
    first = await service.checkpoint()
    assert isinstance(first, CheckpointResult)
    restored = await service.restore(exclude=["b"])
    projector = service.coordinator.projectors[service.run]
    applied_before = projector.events_applied
    # The replacement attempt continues; the old attempt's late event is fenced.
    await service.append(f.boundary("a", "invoke_agent", {"t": 3}, attempt=1))
    await service.append(f.boundary("a", "verify", {"t": 4}, attempt=0))
    second = await service.checkpoint()
    assert isinstance(second, CheckpointResult)
    assert projector.events_applied > applied_before
    assert restored.restore.restore_id in projector._applied_restores
    entries = {
        e.episode: e
        for e in await service.catalog.load_manifest(service.run, second.checkpoint.checkpoint_id)
    }
    assert set(entries) == {"a"}
    assert (entries["a"].attempt, entries["a"].action, entries["a"].last_stage) == (
        1,
        "continue",
        "invoke_agent",
    )
