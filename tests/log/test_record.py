"""The record layout (``log/_record.py``): the service's own records are valid envelopes, and the
peeks read what the builders wrote."""

from __future__ import annotations

from rolloutlog.log import (
    AttemptStarted,
    CheckpointMarker,
    attempt_started_record,
    decode_record,
    encode_record,
    encode_record_dict,
    ledger_digest,
    marker_record,
    record_episode,
    record_meta,
    record_payload,
    record_payload_size,
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


def test_one_digest_for_ids_and_for_their_logged_json() -> None:
    assert ledger_digest("p", [1, 22, 3]) == ledger_digest("p", b"[1,22,3]")
    assert ledger_digest("p", []) == ledger_digest("p", b"[]") == f.ledger_digest("p", [])
    assert ledger_digest("", [5, 6]) == f.ledger_digest("", [5, 6])
    task = {"b": 1, "a": [1.5, None]}
    assert task_digest(task) == task_digest(b'{"a":[1.5,null],"b":1}') == f.task_digest(task)
    assert token_count(b"[]") == 0 and token_count(b"[4,5,6]") == 3
