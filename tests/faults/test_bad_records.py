"""Bad records in a run's log (not an envelope, no type, metadata of the wrong types, records the
fold cannot apply) are quarantined: skipped, recorded in the catalog, counted and listed; the
run's checkpoints keep committing, with the good episodes in their manifests, and the service
restarts over them. Embedded: raw bytes through ``log.append_records`` into the app's own log (a
second process may not open the data dir). Kafka: raw records produced with aiokafka straight
into the run's topic, under a real ``rolloutlog serve``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rolloutlog.log import Record, encode_record, partition_for
from rolloutlog.projections._quarantine import metadata_problem
from rolloutlog.projections._tracker import EpisodeTracker
from tests import factories as f
from tests.api.conftest import RUN, Api, bearer, open_api, settings_for, wire
from tests.e2e._harness import Deployment, kafka_log_url
from tests.faults._supervise import UnreadyService, bad_records, eventually

PARTITIONS = 4


def _samples(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


async def _quarantine(api: Api) -> list[dict[str, Any]]:
    response = await api.call("GET", f"/v1/runs/{RUN}/quarantine", "analyst", 200)
    records: list[dict[str, Any]] = response.json()["records"]
    return records


async def _append_bad(api: Api, episode: str) -> list[tuple[int, int]]:
    """The bad records in ``episode``'s partition, and one good-looking record of ``episode`` in
    a partition it does not belong to."""
    home = partition_for(episode, PARTITIONS)
    other = (home + 1) % PARTITIONS
    good_elsewhere = encode_record(f.boundary(episode, "elsewhere"))
    records = [Record(home, episode.encode(), value) for value in bad_records(episode)]
    records.append(Record(other, episode.encode(), good_elsewhere))
    positions = await api.service.log.append_records(RUN, records)
    return [(p.partition, p.offset) for p in positions]


async def test_bad_records_are_quarantined_and_checkpoints_commit_embedded(tmp_path: Path) -> None:
    settings = settings_for(tmp_path / "data")
    async with open_api(settings) as api:
        await api.seed(["a", "b"])
        bad = await _append_bad(api, "a")
        # a's later events fold as if the bad ones were not there (the string seq poisons nothing)
        await api.append(f.boundary("a", "after-bad", {"turn": 2}))
        result = await api.checkpoint()
        assert result["status"] == "committed", result
        assert result["counts"]["continue"] == 2
        manifest = await api.call(
            "GET", f"/v1/runs/{RUN}/checkpoints/{result['checkpoint_id']}/manifest", "trainer", 200
        )
        stages = {e["episode"]: e for e in manifest.json()["episodes"]}
        assert set(stages) == {"a", "b"}

        async def listed() -> bool:
            return len(await _quarantine(api)) == len(bad)

        await eventually(listed, 10, "the quarantine listing")
        records = await _quarantine(api)
        assert [(r["partition"], r["offset"]) for r in records] == sorted(bad)
        reasons = " | ".join(r["reason"] for r in records)
        assert "not a JSON envelope" in reasons and "no event type" in reasons
        assert "seq" in reasons and "belongs in partition" in reasons
        assert records[0]["size"] > 0 and records[0]["first_bytes"]
        metrics = _samples((await api.client.get("/metrics")).text)
        assert metrics[f'rolloutlog_quarantined_records_total{{run="{RUN}"}}'] == len(bad)
        run = (await api.call("GET", f"/v1/runs/{RUN}", "analyst", 200)).json()
        assert run["health"]["status"] == "ok"
        # A restore continues a from its last good boundary, read past the bad records.
        restored = await api.restore()
        assert restored["counts"]["continue"] == 2
        projection = await api.call(
            "GET",
            f"/v1/runs/{RUN}/episodes/a/projection?restore={restored['restore_id']}",
            "participant",
            200,
        )
        assert projection.json()["boundaries"]["environment"]["stage"] == "after-bad"
    # A restart over the bad records: it starts, ready, and checkpoints commit again.
    async with open_api(settings) as api:
        assert (await api.client.get("/readyz")).status_code == 200
        await api.take_over()
        await api.append(f.boundary("b", "later", attempt=1))
        assert (await api.checkpoint())["status"] == "committed"
        assert len(await _quarantine(api)) == len(bad)  # found again, recorded once


async def test_a_record_the_fold_cannot_apply_is_quarantined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_api(settings_for(tmp_path / "data")) as api:
        await api.seed(["a"])
        original = EpisodeTracker.observe

        def observe(
            self: EpisodeTracker, offset: int, meta: dict[str, Any], record: bytes, start: int
        ) -> bool:
            if meta["type"] == "step.boundary" and meta["data"]["stage"] == "explodes":
                raise RuntimeError("the fold cannot apply this")
            return original(self, offset, meta, record, start)

        monkeypatch.setattr(EpisodeTracker, "observe", observe)
        await api.append(f.boundary("a", "explodes"), f.boundary("a", "fine"))
        assert (await api.checkpoint())["status"] == "committed"

        async def listed() -> bool:
            records = await _quarantine(api)
            return len(records) == 1 and "RuntimeError" in records[0]["reason"]

        await eventually(listed, 10, "the quarantine listing")


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.slow
async def test_bad_records_produced_into_the_topic_kafka(
    tmp_path: Path, kafka_bootstrap: str, postgres_schema: str
) -> None:
    from aiokafka import AIOKafkaProducer

    log_url = kafka_log_url(kafka_bootstrap)
    deployment = Deployment("kafka", tmp_path / "data", log_url, postgres_schema)
    service = UnreadyService(deployment, tmp_path)
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=30) as client:

            async def call(method: str, url: str, role: str, **kw: Any) -> httpx.Response:
                return await client.request(method, url, headers=bearer(role), **kw)

            run = "badrecs"
            created = await call(
                "POST", "/v1/runs", "trainer", json={"run": run, "partitions": PARTITIONS}
            )
            assert created.status_code == 201, created.text
            await call(
                "POST",
                f"/v1/runs/{run}/participants",
                "participant",
                json={"id": "env-0", "kind": "environment"},
            )
            epoch = (await call("POST", f"/v1/runs/{run}/controller", "trainer")).json()[
                "controller_epoch"
            ]
            events = [f.started("a"), f.boundary("a", "seed"), f.started("b"), f.boundary("b")]
            body = wire(*events)
            assert (
                await call("POST", f"/v1/runs/{run}/events", "participant", json=body)
            ).status_code == 200
            prefix = log_url.split("topic_prefix=")[1]
            producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
            await producer.start()
            try:
                for value in bad_records("a"):
                    await producer.send_and_wait(
                        f"{prefix}{run}", value, key=b"a", partition=partition_for("a", PARTITIONS)
                    )
            finally:
                await producer.stop()
            after = wire(f.boundary("a", "after-bad"))
            assert (
                await call("POST", f"/v1/runs/{run}/events", "participant", json=after)
            ).status_code == 200

            async def checkpoint() -> dict[str, Any]:
                response = await call(
                    "POST",
                    f"/v1/runs/{run}/checkpoints",
                    "trainer",
                    json={"controller_epoch": epoch},
                )
                assert response.status_code == 201, response.text
                result: dict[str, Any] = response.json()
                return result

            result = await checkpoint()
            assert result["counts"]["continue"] == 2

            async def listed() -> bool:
                response = await call("GET", f"/v1/runs/{run}/quarantine", "analyst")
                return len(response.json()["records"]) == len(bad_records("a"))

            await eventually(listed, 15, "the quarantine listing")
            # SIGKILL and restart over the bad records: it starts, ready, checkpoints commit.
            service.kill()
            await service.start()

            async def ready() -> bool:
                return (await client.get("/readyz")).status_code == 200

            await eventually(ready, 30, "readiness after the restart")
            assert (await checkpoint())["status"] == "committed"
            manifest = await call(
                "GET", f"/v1/runs/{run}/checkpoints/{result['checkpoint_id']}/manifest", "trainer"
            )
            assert {e["episode"] for e in manifest.json()["episodes"]} == {"a", "b"}
    finally:
        service.stop()


def test_the_metadata_check_names_what_is_wrong() -> None:
    good = orjson.loads(encode_record(f.ledger_row("a", token_ids=[1, 2])).split(b"\n")[0])
    assert metadata_problem(good) is None
    assert metadata_problem(orjson.loads(encode_record(f.started("a")).split(b"\n")[0])) is None

    def broken(**changes: Any) -> str | None:
        meta = orjson.loads(orjson.dumps(good))
        for path, value in changes.items():
            *parents, last = path.split("__")
            target = meta
            for parent in parents:
                target = target[parent]
            target[last] = value
        return metadata_problem(meta)

    assert metadata_problem([1, 2]) == "the record is JSON but not an object (list)"
    assert broken(type=["x"]) == "its type is not a string"
    assert broken(type="no.such") == "unknown event type 'no.such'"
    assert "data is not an object" in str(broken(data=[]))
    assert "participant" in str(broken(participant__epoch="1"))
    assert "seq and attempt" in str(broken(seq=True))
    assert "ts must be a number" in str(broken(ts="now"))
    assert "episode id" in str(broken(episode="not an id"))
    assert broken(data__cum_len="3") == "ledger.row: data.cum_len has the wrong type"
    assert broken(data__constrained=1) == "ledger.row: data.constrained has the wrong type"


def test_the_metadata_check_follows_the_models() -> None:
    """Derived from the models (``core/_shapes.py``): a required field must be there, a default
    may be left out, None only where the model allows it."""

    def meta(event: Any, **data: Any) -> dict[str, Any]:
        value: dict[str, Any] = orjson.loads(encode_record(event).split(b"\n")[0])
        value["data"].update(data)
        return value

    step = meta(f.step_started("a"))
    assert metadata_problem(step) is None
    del step["data"]["mode"]  # the default
    assert metadata_problem(step) is None
    wrong = "step.started: data.{} has the wrong type"
    assert metadata_problem(meta(f.step_started("a"), mode=None)) == wrong.format("mode")
    stageless = meta(f.step_started("a"))
    del stageless["data"]["stage"]  # required: the fold reads data["stage"]
    assert metadata_problem(stageless) == wrong.format("stage")
    row = meta(f.ledger_row("a", token_ids=[1]))
    del row["data"]["parent_call_id"]  # required, though it may be null
    assert metadata_problem(row) == "ledger.row: data.parent_call_id has the wrong type"
    assert metadata_problem(meta(f.ledger_row("a", token_ids=[1]), parent_call_id=None)) is None
    state = meta(f.session_state("a"), checkpoint_id="3")
    assert metadata_problem(state) == "session.state: data.checkpoint_id has the wrong type"
    assert metadata_problem(meta(f.session_state("a"), checkpoint_id=3)) is None


async def test_quarantine_records_wait_for_a_catalog_that_is_down(tmp_path: Path) -> None:
    async with open_api(settings_for(tmp_path / "data")) as api:
        await api.seed(["a"])
        projector = api.service.coordinator.projectors[RUN]
        await api.service.catalog.stop()  # the catalog goes away
        try:
            home = partition_for("a", PARTITIONS)
            await api.service.log.append_records(RUN, [Record(home, b"a", b"not json")])
            await api.service.log.append(RUN, [f.boundary("a", "while-down")])

            async def folded() -> bool:
                tracker = projector.trackers["a"]
                return projector.quarantined_count == 1 and tracker.last_stage == "while-down"

            await eventually(folded, 10, "the projector going on past the bad record")
            await asyncio.sleep(1.5)  # a recording attempt fails meanwhile
            assert projector.new_quarantined  # kept for the next attempt
        finally:
            await api.service.catalog.start()

        async def listed() -> bool:
            return len(await _quarantine(api)) == 1

        await eventually(listed, 10, "the quarantine listing after the catalog is back")
