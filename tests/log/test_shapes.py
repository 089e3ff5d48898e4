"""The data shapes derived from the models (``core/_shapes.py``) and the envelope checker built on
them: every event type covered, in model order, and a field added to a model checked by the
append's fast path, the projector's record check and the SDK's check without editing them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rolloutlog.core._check import _CLIENT, _RECORD_TYPES
from rolloutlog.core._events import EVENT_CLASSES
from rolloutlog.core._shapes import (
    DATA_RULES,
    DATA_SHAPES,
    OPAQUE_FIELD,
    PAYLOAD_FIELD,
    REQUIRED,
    _payload_fields,
)
from rolloutlog.log import SERVICE_EVENT_TYPES


def test_every_event_type_in_model_order() -> None:
    assert DATA_SHAPES.keys() == EVENT_CLASSES.keys()
    for kind, cls in EVENT_CLASSES.items():
        model = cls.model_fields["data"].annotation
        assert isinstance(model, type)
        fields = model.model_fields
        shapes = DATA_SHAPES[kind]
        assert [shape.name for shape in shapes] == list(fields), kind
        for shape in shapes:
            info = fields[shape.name]
            assert (shape.default is REQUIRED) == info.is_required(), (kind, shape.name)
            if shape.default is not REQUIRED:
                assert shape.default == info.default


def test_payload_fields_are_the_record_layouts() -> None:
    # Derived from the models, pinned here to the stored record layout (docs/design.md, "Records
    # keep metadata apart from payloads"): a model change that moved a payload changes the format.
    assert OPAQUE_FIELD == {
        "episode.started": "task",
        "step.boundary": "state",
        "session.state": "state",
        "episode.finished": "result",
    }
    assert PAYLOAD_FIELD == {
        **OPAQUE_FIELD,
        "ledger.row": "token_ids",
        "generation.chunk": "token_ids",
    }
    assert DATA_RULES.keys() == {"ledger.row"}


def test_a_model_with_two_payload_fields_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    shapes = {
        **DATA_SHAPES,
        "step.boundary": (*DATA_SHAPES["step.boundary"], DATA_SHAPES["episode.started"][0]),
    }
    monkeypatch.setattr("rolloutlog.core._shapes.DATA_SHAPES", shapes)
    with pytest.raises(TypeError, match=r"step\.boundary: more than one payload field"):
        _payload_fields(None)


def test_shapes_read_the_constraints() -> None:
    shapes = {shape.name: shape for shape in DATA_SHAPES["ledger.row"]}
    assert (shapes["call_id"].constraint, shapes["call_id"].nullable) == ("name", False)
    assert (shapes["parent_call_id"].constraint, shapes["parent_call_id"].nullable) == (
        "name",
        True,
    )
    assert shapes["parent_call_id"].default is REQUIRED
    assert (shapes["digest"].constraint, shapes["digest"].lengths) == ("digest", (1, 128))
    assert (shapes["prev_len"].json, shapes["prev_len"].constraint) == ("int", "non_negative")
    assert (shapes["staging_key"].json, shapes["staging_key"].default) == ("str", None)
    assert (shapes["constrained"].json, shapes["constrained"].default) == ("bool", False)
    assert shapes["token_ids"].json == "tokens"
    mode = DATA_SHAPES["session.started"][1]
    assert (mode.constraint, mode.default) == ("choices", "restart_only")
    assert mode.choices == {"restart_only", "stateless", "exported", "checkpoint"}
    assert DATA_SHAPES["episode.finished"][0].json == "number"


def test_the_checker_and_the_record_check_are_built_from_the_shapes() -> None:
    assert _CLIENT.keys() == EVENT_CLASSES.keys() - SERVICE_EVENT_TYPES
    for kind, spec in _CLIENT.items():
        metadata = [shape for shape in DATA_SHAPES[kind] if not shape.payload]
        assert [(name, default, nullable) for name, _, default, nullable in spec.fields] == [
            (shape.name, shape.default, shape.nullable) for shape in metadata
        ]
        assert spec.keys == {shape.name for shape in DATA_SHAPES[kind]}
    assert _RECORD_TYPES.keys() == EVENT_CLASSES.keys()
    for kind, fields in _RECORD_TYPES.items():
        assert [name for name, _, _ in fields] == [
            shape.name for shape in DATA_SHAPES[kind] if not shape.payload
        ]


_NEW_FIELD = textwrap.dedent(
    """
    import orjson
    from rolloutlog.core import _events
    from rolloutlog.log import encode_record
    from rolloutlog.core._events import Name, NonNegative, StepStarted, StepStartedData

    def _rule(data):
        return "count above 5 needs a note" if data["count"] > 5 and data["note"] is None else None

    class Data(StepStartedData):
        note: Name | None = None
        count: NonNegative = 0

        rule = _rule

    class Envelope(StepStarted):
        data: Data

    _events.EVENT_CLASSES["step.started"] = Envelope

    # The package's import built the append's table already: derive it again.
    import importlib
    from rolloutlog.core import _shapes
    from rolloutlog.core import _check

    import rolloutlog.core
    import rolloutlog.log

    importlib.reload(_shapes)
    for package in (rolloutlog.core, rolloutlog.log):
        package.DATA_SHAPES = _shapes.DATA_SHAPES
        package.DATA_RULES = _shapes.DATA_RULES
    importlib.reload(_check)
    from rolloutlog.log import _record

    _record.check_envelope = rolloutlog.core.check_envelope = _check.check_envelope
    rolloutlog.core.record_holds = _check.record_holds
    rolloutlog.core.wrong_record_field = _check.wrong_record_field
    from rolloutlog.log import fast_record
    from rolloutlog.projections._quarantine import metadata_problem

    good = {
        "episode": "e1", "participant": {"id": "env", "kind": "environment", "epoch": 0},
        "seq": 0, "ts": 1.5, "type": "step.started",
        "data": {"owner": "env", "stage": "s", "note": "n.1", "count": 2},
    }
    record = encode_record(Envelope.model_validate(good))
    assert fast_record(good)[0] == record, (fast_record(good), record)
    meta = orjson.loads(record)
    assert list(meta["data"]) == ["owner", "stage", "mode", "note", "count"], meta
    assert metadata_problem(meta) is None
    for field, bad in (("note", "bad name"), ("note", 3), ("count", -1), ("count", "2")):
        value = {**good, "data": {**good["data"], field: bad}}
        assert fast_record(value) is None, value
    # The model's rule: refused by the model, left to it by the fast path and the SDK's check.
    unruly = {**good, "data": {**good["data"], "note": None, "count": 6}}
    assert fast_record(unruly) is None
    try:
        Envelope.model_validate(unruly)
    except ValueError as e:
        assert "count above 5 needs a note" in str(e), e
    else:
        raise AssertionError("the model took a data breaking its rule")
    for field, bad in (("note", 3), ("count", "2"), ("count", None)):
        wrong = {**meta, "data": {**meta["data"], field: bad}}
        assert metadata_problem(wrong) == f"step.started: data.{field} has the wrong type"

    from rolloutlog.core import check_envelope

    def sdk_check(data):
        return check_envelope({**good, "data": data}) is not None

    built = {"owner": "env", "stage": "s", "mode": "wait", "note": None, "count": 2}
    assert sdk_check(built)
    assert not sdk_check({**built, "count": -1})
    assert not sdk_check({**built, "count": 6})
    assert sdk_check({**built, "note": "n", "count": 6})
    print("ok")
    """
)


def test_a_field_added_to_a_model_is_checked_by_every_fast_path() -> None:
    # In a fresh interpreter: the tables are derived when the fast paths are first imported.
    done = subprocess.run(
        [sys.executable, "-c", _NEW_FIELD], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
