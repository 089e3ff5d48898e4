"""The SDK's own encoders and the cheap checks of the envelopes its participant classes build.

The participant classes build complete envelopes whose shape is fixed by the SDK; only a few
values come from the caller (episode ids, stage, session and call ids, digests, counts, token
lists, rewards). ``check_built`` checks exactly those with plain type tests and the name regex
(~1 us) instead of pydantic (~4 us); any envelope that is not in the exact shape the SDK builds
(a field missing or extra, a payload that is not ``Opaque`` yet, an unknown type) goes to
``validate_event``, which stays the authority: it accepts what pydantic accepts and refuses with
the same ``InvalidEvent`` (field and reason) otherwise.

Records are encoded by ``rolloutlog.log.encode_record_dict``, the record layout's own encoder for
dict envelopes (the same bytes as the codec's for a valid envelope, tested per event type); the
participant classes build envelopes in the envelope model's field order, which the layout's peeks
use when they can.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from rolloutlog.log import (
    DATA_RULES,
    DATA_SHAPES,
    NAME_PATTERN,
    SERVICE_EVENT_TYPES,
    FieldShape,
    Opaque,
    encode_opaque,
    encode_record,
    encode_record_dict,
    episode_id_problem,
    validate_event,
)

__all__ = ["check_built", "encode_record_fast", "encode_wire"]


def encode_wire(event: dict[str, Any]) -> bytes:
    """An envelope as one JSON object (opaque payloads embedded as their raw bytes)."""
    return orjson.dumps(event, default=encode_opaque)


#: The SDK's record encoder is the log's (``rolloutlog.log``'s record layout, for dict envelopes).
encode_record_fast = encode_record_dict


# -- the cheap checks ------------------------------------------------------------------------
#
# One generated expression per event type, from the models' data shapes (``log/_shapes.py``),
# testing each field inline (a call per field cost as much as the test itself). A value of the
# wrong type may raise TypeError (the regex on a non-string, a set lookup of an unhashable
# value): ``_fits`` takes that as "not in the SDK's shape".

_name = re.compile(NAME_PATTERN.removeprefix("^").removesuffix("$")).fullmatch  # as log's ids
_INTS = {int}
#: Episode ids seen valid (an episode records many events); bounded, cleared when full.
_episodes: set[str] = set()
_EPISODE_CACHE = 1 << 16


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _tokens(value: Any) -> bool:
    # strict list[int]: a bool is not a token (one C-level pass over the types)
    return type(value) is list and (not value or set(map(type, value)) == _INTS)


def _field_check(index: int, shape: FieldShape) -> str:
    """The source of one field's test on ``d[name]`` (``c<index>``: its choices)."""
    value = f"d[{shape.name!r}]"
    if shape.constraint == "name":
        check = f"_name({value}) is not None"
    elif shape.constraint == "digest":
        low, high = shape.lengths
        check = f"type({value}) is str and {low} <= len({value}) <= {high}"
    elif shape.constraint == "non_negative":
        check = f"_count({value})"
    elif shape.constraint == "choices":
        check = f"type({value}) is str and {value} in c{index}"
    else:
        check = {
            "str": "type({0}) is str",
            "int": "type({0}) is int",
            "number": "type({0}) is float or type({0}) is int",
            "bool": "type({0}) is bool",
            "opaque": "type({0}) is Opaque",
            "tokens": "_tokens({0})",
        }[shape.json].format(value)
    return f"({value} is None or {check})" if shape.nullable else f"({check})"


def _data_check(kind: str, shapes: tuple[FieldShape, ...]) -> Callable[[dict[str, Any]], bool]:
    """Whether a data dict has exactly the model's fields, each valid (see ``_field_check``), and
    follows the model's rule across fields, if it has one (``DATA_RULES``)."""
    tests = [f"len(d) == {len(shapes)}"]
    tests += [_field_check(index, shape) for index, shape in enumerate(shapes)]
    tests += ["_rule(d) is None"] if kind in DATA_RULES else []
    namespace: dict[str, Any] = {"_name": _name, "_count": _count, "_tokens": _tokens}
    namespace["_rule"] = DATA_RULES.get(kind)
    namespace |= {"Opaque": Opaque}
    namespace |= {f"c{index}": shape.choices for index, shape in enumerate(shapes)}
    check: Callable[[dict[str, Any]], bool] = eval(f"lambda d: {' and '.join(tests)}", namespace)
    return check


_DATA: dict[str, Callable[[dict[str, Any]], bool]] = {
    kind: _data_check(kind, shapes)
    for kind, shapes in DATA_SHAPES.items()
    if kind not in SERVICE_EVENT_TYPES
}


def _fits(event: dict[str, Any]) -> bool:
    """Whether an envelope is in the shape the SDK builds with valid values: exactly the
    envelope's nine fields and the type's data fields (counted, then each read), each valid."""
    try:
        if len(event) != 9 or type(event["v"]) is not int or event["v"] != 1:
            return False
        data = event["data"]
        if type(data) is not dict or not _DATA[event["type"]](data):
            return False
        step = event["step"]
        if not (
            _count(event["attempt"])
            and (step is None or _count(step))
            and _count(event["seq"])
            and type(event["ts"]) is float
            and type(event["participant"]) is dict
        ):
            return False
        episode = event["episode"]
        if episode in _episodes:
            return True
        if type(episode) is not str or episode_id_problem(episode) is not None:
            return False
        if len(_episodes) >= _EPISODE_CACHE:
            _episodes.clear()
        _episodes.add(episode)
        return True
    except (KeyError, TypeError):
        return False


def check_built(event: dict[str, Any]) -> bytes:
    """Check an envelope a participant class built and return its log record.

    The fast path checks the caller-supplied values by type and pattern; anything else is
    validated by pydantic (raising ``InvalidEvent`` as the service would) and encoded by the
    codec. The ``participant`` field is the participant's own (checked at registration).
    """
    if _fits(event):
        return encode_record_fast(event)
    return encode_record(validate_event(event))
