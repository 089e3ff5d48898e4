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
    Opaque,
    encode_record,
    encode_record_dict,
    episode_id_problem,
    validate_event,
)

__all__ = ["check_built", "encode_record_fast", "encode_wire"]


def _default(value: Any) -> Any:
    if isinstance(value, Opaque):
        return orjson.Fragment(value.raw)
    raise TypeError(f"cannot encode {type(value).__name__}")


def encode_wire(event: dict[str, Any]) -> bytes:
    """An envelope as one JSON object (opaque payloads embedded as their raw bytes)."""
    return orjson.dumps(event, default=_default)


#: The SDK's record encoder is the log's (``rolloutlog.log``'s record layout, for dict envelopes).
encode_record_fast = encode_record_dict


# -- the cheap checks ------------------------------------------------------------------------
#
# One function per event type, testing each field inline (a call per field cost as much as the
# test itself). A value of the wrong type may raise TypeError (the regex on a non-string, a set
# lookup of an unhashable value): ``_fits`` takes that as "not in the SDK's shape".

_name = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}").fullmatch
_STEP_MODES = frozenset(("replay", "wait"))
_SESSION_MODES = frozenset(("restart_only", "stateless", "exported", "checkpoint"))
_INTS = {int}
#: Episode ids seen valid (an episode records many events); bounded, cleared when full.
_episodes: set[str] = set()
_EPISODE_CACHE = 1 << 16


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _digest(value: Any) -> bool:
    return type(value) is str and 0 < len(value) <= 128


def _tokens(value: Any) -> bool:
    # strict list[int]: a bool is not a token (one C-level pass over the types)
    return type(value) is list and (not value or set(map(type, value)) == _INTS)


def _number_or_none(value: Any) -> bool:
    return value is None or type(value) is float or type(value) is int


def _episode_started(data: dict[str, Any]) -> bool:
    return (
        len(data) == 3
        and type(data["task"]) is Opaque
        and _digest(data["task_digest"])
        and _number_or_none(data["deadline_s"])
    )


def _step_started(data: dict[str, Any]) -> bool:
    return (
        len(data) == 3
        and _name(data["owner"]) is not None
        and _name(data["stage"]) is not None
        and type(data["mode"]) is str
        and data["mode"] in _STEP_MODES
    )


def _step_boundary(data: dict[str, Any]) -> bool:
    after = data["next"]
    return (
        len(data) == 4
        and _name(data["owner"]) is not None
        and _name(data["stage"]) is not None
        and (after is None or _name(after) is not None)
        and type(data["state"]) is Opaque
    )


def _calls(data: dict[str, Any]) -> bool:
    """The fields ledger rows and generation chunks share."""
    parent, staging = data["parent_call_id"], data["staging_key"]
    return (
        _name(data["call_id"]) is not None
        and (parent is None or _name(parent) is not None)
        and _count(data["policy_version"])
        and _tokens(data["token_ids"])
        and (staging is None or type(staging) is str)
    )


def _ledger_row(data: dict[str, Any]) -> bool:
    return (
        len(data) == 11
        and _calls(data)
        and _digest(data["fingerprint"])
        and _digest(data["context_digest"])
        and _digest(data["digest"])
        and _count(data["prev_len"])
        and _count(data["cum_len"])
        and data["cum_len"] == data["prev_len"] + len(data["token_ids"])
        and type(data["constrained"]) is bool
    )


def _generation_chunk(data: dict[str, Any]) -> bool:
    return (
        len(data) == 8
        and _calls(data)
        and _digest(data["request_digest"])
        and _count(data["start"])
        and type(data["done"]) is bool
    )


def _session_started(data: dict[str, Any]) -> bool:
    return (
        len(data) == 3
        and _name(data["session_id"]) is not None
        and type(data["mode"]) is str
        and data["mode"] in _SESSION_MODES
        and type(data["verify"]) is str
        and data["verify"] in _STEP_MODES
    )


def _session_state(data: dict[str, Any]) -> bool:
    checkpoint_id = data["checkpoint_id"]
    return (
        len(data) == 3
        and _name(data["session_id"]) is not None
        and type(data["state"]) is Opaque
        and (checkpoint_id is None or _count(checkpoint_id))
    )


def _session_ended(data: dict[str, Any]) -> bool:
    return len(data) == 1 and _name(data["session_id"]) is not None


def _episode_finished(data: dict[str, Any]) -> bool:
    result = data["result"]
    return (
        len(data) == 2
        and _number_or_none(data["reward"])
        and (result is None or type(result) is Opaque)
    )


_DATA: dict[str, Callable[[dict[str, Any]], bool]] = {
    "episode.started": _episode_started,
    "step.started": _step_started,
    "step.boundary": _step_boundary,
    "ledger.row": _ledger_row,
    "generation.chunk": _generation_chunk,
    "session.started": _session_started,
    "session.state": _session_state,
    "session.ended": _session_ended,
    "episode.finished": _episode_finished,
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
