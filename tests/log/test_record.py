"""The record layout (``log/_record.py``): the service's own records are valid envelopes, and the
peeks read what the builders wrote."""

from __future__ import annotations

import orjson

from rolloutlog.log import (
    AttemptStarted,
    CheckpointMarker,
    attempt_started_record,
    attempt_started_records,
    decode_record,
    encode_record,
    encode_record_dict,
    is_delta,
    ledger_digest,
    marker_record,
    peek_record,
    record_episode,
    record_meta,
    record_payload,
    record_payload_size,
    record_payload_start,
    record_restore_id,
    split_record,
    task_digest,
    token_count,
)
from tests import factories as f


def test_the_service_records_are_valid_envelopes_and_peekable() -> None:
    record = attempt_started_record(
        "r1-a",
        3,
        restore_id=417,
        checkpoint_id=9,
        previous_attempt=2,
        cut=12,
        controller_epoch=5,
        ts=1.5,
    )
    event = decode_record(record)
    assert isinstance(event, AttemptStarted)
    assert (event.episode, event.attempt, event.participant.id, event.participant.epoch) == (
        "r1-a",
        3,
        "rolloutlog",
        5,
    )
    assert (event.data.restore_id, event.data.previous_attempt, event.data.cut) == (417, 2, 12)
    assert encode_record(event) == record  # the builder writes the model's field order
    assert record_restore_id(record) == 417
    assert record_episode(record) == "r1-a"
    marker = marker_record(7, 5, 2.5)
    decoded = decode_record(marker)
    assert isinstance(decoded, CheckpointMarker)
    assert (decoded.data.checkpoint_id, decoded.seq, decoded.episode) == (7, 7, None)
    assert encode_record(decoded) == marker
    assert record_restore_id(marker) is None and record_episode(marker) is None


def test_restore_ids_are_read_off_the_service_records_only() -> None:
    assert record_restore_id(encode_record(f.started("r1"))) is None
    # A payload that spells the same bytes is not a restore.
    state = {"type": "attempt.started", "data": {"restore_id": 5, "cut": 1}}
    assert record_restore_id(encode_record(f.boundary("r1", "seed", state))) is None


def test_payload_peeks_and_the_dict_encoder() -> None:
    event = f.ledger_row("r1", "c1", [1, 2, 3])
    record = encode_record(event)
    meta, payload = split_record(record)
    assert record_meta(record) == meta and "token_ids" not in meta["data"]
    assert payload == b"[1,2,3]" == record_payload(record)
    assert record_payload_size(record) == len(payload)
    assert record_payload(encode_record(f.step_started("r1"))) is None
    assert record_payload_size(encode_record(f.step_started("r1"))) == 0
    assert encode_record_dict(event.model_dump()) == record


def test_the_peeks_read_a_record_read_in_place_as_they_read_its_bytes() -> None:
    """A large record a composition reads in place is a read-only view (``BlobStore.view``):
    the peeks it uses give what they give the record's bytes, whether its metadata is longer
    than the first window searched or it has no payload at all."""
    long_meta = {"v": 1, "episode": "r1", "type": "step.started", "data": {"pad": "p" * 20_000}}
    records = [
        encode_record(f.session_state("r1", state={"b": "x" * 100_000})),
        encode_record(f.ledger_row("r1", "c1", list(range(20_000)))),
        encode_record(f.step_started("r1")),
        orjson.dumps(long_meta) + b"\n" + b'{"$delta":{"k":1}}',
        orjson.dumps(long_meta),
        orjson.dumps({"type": "step.started", "episode": "r2", "data": {}}) + b"\n[1]",
    ]
    for record in records:
        view = memoryview(record)
        assert peek_record(view) == peek_record(record)
        assert record_meta(view) == record_meta(record)
        assert record_payload_start(view) == record_payload_start(record)
        assert record_episode(view) == record_episode(record)
        start = record_payload_start(record)
        assert is_delta(view, start) == is_delta(record, start)
    assert is_delta(memoryview(records[3]), record_payload_start(records[3]))


def test_one_digest_for_ids_and_for_their_logged_json() -> None:
    assert ledger_digest("p", [1, 22, 3]) == ledger_digest("p", b"[1,22,3]")
    assert ledger_digest("p", []) == ledger_digest("p", b"[]") == f.ledger_digest("p", [])
    assert ledger_digest("", [5, 6]) == f.ledger_digest("", [5, 6])
    task = {"b": 1, "a": [1.5, None]}
    assert task_digest(task) == task_digest(b'{"a":[1.5,null],"b":1}') == f.task_digest(task)
    assert token_count(b"[]") == 0 and token_count(b"[4,5,6]") == 3


def test_a_restores_records_are_the_records_of_their_whole_envelopes() -> None:
    """``attempt_started_records`` fills a template: each record is the same bytes as orjson's
    encoding of its whole envelope, and as ``attempt_started_record``'s."""
    rows = [("r1-a", 1, 0, 0), ("r1-a2.b_c:d", 7, 6, 123_456_789_012), ("x", 2**40, 2**40 - 1, 5)]
    for ts, epoch, restore_id in ((1.5, 5, 417), (1_733_493_000.123456, 2**33, 1), (0.0, 1, 9)):
        records = attempt_started_records(
            rows, restore_id=restore_id, checkpoint_id=9, controller_epoch=epoch, ts=ts
        )
        assert len(records) == len(rows)
        for (episode, attempt, previous, cut), record in zip(rows, records, strict=True):
            whole = {
                "v": 1,
                "episode": episode,
                "attempt": attempt,
                "step": None,
                "participant": {"id": "rolloutlog", "kind": "service", "epoch": epoch},
                "seq": restore_id,
                "ts": ts,
                "type": "attempt.started",
                "data": {
                    "restore_id": restore_id,
                    "checkpoint_id": 9,
                    "previous_attempt": previous,
                    "cut": cut,
                },
            }
            assert record == orjson.dumps(whole)
            assert record == attempt_started_record(
                episode,
                attempt,
                restore_id=restore_id,
                checkpoint_id=9,
                previous_attempt=previous,
                cut=cut,
                controller_epoch=epoch,
                ts=ts,
            )
            assert encode_record(decode_record(record)) == record
            assert record_restore_id(record) == restore_id and record_episode(record) == episode
    assert (
        attempt_started_records([], restore_id=1, checkpoint_id=1, controller_epoch=1, ts=1) == []
    )
