"""The SDK's own encoders and the cheap checks of the envelopes its participant classes build.

The participant classes build complete envelopes whose shape is fixed by the SDK; only a few
values come from the caller (episode ids, stage, session and call ids, digests, counts, token
lists, rewards). ``check_built`` checks exactly those with plain type tests and the name regex
(~1 us) instead of pydantic (~4 us); any envelope that is not in the exact shape the SDK builds
(a field missing or extra, a payload that is not ``Opaque`` yet, an unknown type) goes to
``validate_event``, which stays the authority: it accepts what pydantic accepts and refuses with
the same ``InvalidEvent`` (field and reason) otherwise.

The encoders write what ``rolloutlog.log``'s codec writes (tested per event type): the record of
an envelope is its metadata JSON with the payload field left out, then a newline and the payload's
raw JSON; the participant classes build envelopes in the codec's field order (``v``, ``episode``,
…), so records start the way ``record_episode`` reads without decoding.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from rolloutlog.log import Opaque, encode_record, episode_id_problem, validate_event

__all__ = ["PAYLOAD_FIELDS", "check_built", "encode_record_fast", "encode_wire"]


def _default(value: Any) -> Any:
    if isinstance(value, Opaque):
        return orjson.Fragment(value.raw)
    raise TypeError(f"cannot encode {type(value).__name__}")


def encode_wire(event: dict[str, Any]) -> bytes:
    """An envelope as one JSON object (opaque payloads embedded as their raw bytes)."""
    return orjson.dumps(event, default=_default)


#: The field of each event type a log record keeps apart from its metadata (``rolloutlog.log``'s
#: record format: metadata JSON, then a newline and the payload's raw JSON).
PAYLOAD_FIELDS = {
    "episode.started": "task",
    "step.boundary": "state",
    "session.state": "state",
    "episode.finished": "result",
    "ledger.row": "token_ids",
    "generation.chunk": "token_ids",
}


def encode_record_fast(event: dict[str, Any]) -> bytes:
    """The log record of an envelope, without pydantic: the same meaning as
    ``encode_record(validate_event(event))`` for a valid envelope (tested per event type).

    The payload is taken out of ``data`` for the metadata's encoding and put back (no copy of
    the envelope); a payload already ``Opaque`` is appended as its raw bytes.
    """
    field = PAYLOAD_FIELDS.get(event["type"])
    data = event["data"]
    if field is None or field not in data:
        return orjson.dumps(event, default=_default)
    payload = data.pop(field)
    try:
        head = orjson.dumps(event)
    finally:
        data[field] = payload
    if payload is None:
        return head
    if type(payload) is Opaque:
        return b"%b\n%b" % (head, payload.raw)
    return b"%b\n%b" % (head, orjson.dumps(payload, default=_default))


# -- the cheap checks ------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
#: Episode ids seen valid (an episode records many events); bounded, cleared when full.
_episodes: set[str] = set()
_EPISODE_CACHE = 1 << 16


def _name(value: Any) -> bool:
    return type(value) is str and _NAME.fullmatch(value) is not None


def _name_or_none(value: Any) -> bool:
    return value is None or (type(value) is str and _NAME.fullmatch(value) is not None)


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _digest(value: Any) -> bool:
    return type(value) is str and 0 < len(value) <= 128


def _text_or_none(value: Any) -> bool:
    return value is None or type(value) is str


def _flag(value: Any) -> bool:
    return type(value) is bool


def _number_or_none(value: Any) -> bool:
    return value is None or type(value) is float or type(value) is int


def _opaque(value: Any) -> bool:
    return type(value) is Opaque


def _opaque_or_none(value: Any) -> bool:
    return value is None or type(value) is Opaque


def _tokens(value: Any) -> bool:
    # strict list[int]: a bool is not a token (one C-level pass over the types)
    return type(value) is list and (not value or set(map(type, value)) == {int})


_STEP_MODES = frozenset(("replay", "wait"))
_SESSION_MODES = frozenset(("restart_only", "stateless", "exported"))


def _step_mode(value: Any) -> bool:
    return type(value) is str and value in _STEP_MODES


def _session_mode(value: Any) -> bool:
    return type(value) is str and value in _SESSION_MODES


Check = Callable[[Any], bool]

#: Per event type the SDK builds: its data's exact fields, each with its check.
_DATA: dict[str, dict[str, Check]] = {
    "episode.started": {"task": _opaque, "task_digest": _digest, "deadline_s": _number_or_none},
    "step.started": {"owner": _name, "stage": _name, "mode": _step_mode},
    "step.boundary": {"owner": _name, "stage": _name, "next": _name_or_none, "state": _opaque},
    "ledger.row": {
        "call_id": _name,
        "parent_call_id": _name_or_none,
        "fingerprint": _digest,
        "context_digest": _digest,
        "policy_version": _count,
        "prev_len": _count,
        "token_ids": _tokens,
        "cum_len": _count,
        "digest": _digest,
        "staging_key": _text_or_none,
        "constrained": _flag,
    },
    "generation.chunk": {
        "call_id": _name,
        "parent_call_id": _name_or_none,
        "request_digest": _digest,
        "start": _count,
        "token_ids": _tokens,
        "policy_version": _count,
        "staging_key": _text_or_none,
        "done": _flag,
    },
    "session.started": {"session_id": _name, "mode": _session_mode, "verify": _step_mode},
    "session.state": {"session_id": _name, "state": _opaque},
    "session.ended": {"session_id": _name},
    "episode.finished": {"reward": _number_or_none, "result": _opaque_or_none},
}
_CHECKS = {kind: tuple(fields.items()) for kind, fields in _DATA.items()}
_FIELDS = {kind: fields.keys() for kind, fields in _DATA.items()}
_ENVELOPE = frozenset(
    ("v", "episode", "attempt", "step", "participant", "seq", "ts", "type", "data")
)


def _fits(event: dict[str, Any]) -> bool:
    """Whether an envelope is in the shape the SDK builds with valid values (no allocation on
    the way: this runs for every event on the Kafka path)."""
    kind = event.get("type")
    checks = _CHECKS.get(kind)  # type: ignore[arg-type]
    if checks is None or event.keys() != _ENVELOPE or event["v"] != 1:
        return False
    data = event["data"]
    if type(data) is not dict or data.keys() != _FIELDS[kind]:  # type: ignore[index]
        return False
    for field, check in checks:
        if not check(data[field]):
            return False
    if kind == "ledger.row" and data["cum_len"] != data["prev_len"] + len(data["token_ids"]):
        return False
    step = event["step"]
    if not (_count(event["attempt"]) and (step is None or _count(step))):
        return False
    if not (_count(event["seq"]) and type(event["ts"]) is float):
        return False
    episode = event["episode"]
    if type(episode) is not str:
        return False
    if episode not in _episodes:
        if episode_id_problem(episode) is not None:
            return False
        if len(_episodes) >= _EPISODE_CACHE:
            _episodes.clear()
        _episodes.add(episode)
    return True


def check_built(event: dict[str, Any]) -> bytes:
    """Check an envelope a participant class built and return its log record.

    The fast path checks the caller-supplied values by type and pattern; anything else is
    validated by pydantic (raising ``InvalidEvent`` as the service would) and encoded by the
    codec. The ``participant`` field is the participant's own (checked at registration).
    """
    if _fits(event):
        return encode_record_fast(event)
    return encode_record(validate_event(event))
