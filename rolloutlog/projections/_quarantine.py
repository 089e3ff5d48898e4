"""Which log records the projector cannot take: not a rolloutlog envelope, or metadata of the wrong
shape where the fold reads it.

Anyone on the direct Kafka path can produce into a run's topic, so the projector checks what it
reads instead of trusting it. The check covers exactly the metadata fields the tracker and the fold
read (a full pydantic validation of every record would cost the projector most of its speed), so a
record that passes cannot poison the per-episode state that later good records are folded into
(a ``seq`` that is a string, say, would make every later comparison of that participant raise).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

from rolloutlog.log import episode_id_problem

__all__ = ["metadata_problem"]

_NUMBER = (int, float)

# Per event type: the ``data`` fields the tracker and the fold read, with the types they need
# (``None`` allowed where the field is optional).
_STR, _INT, _OPT_STR, _OPT_INT, _OPT_NUMBER, _OPT_BOOL = (
    "str",
    "int",
    "str?",
    "int?",
    "num?",
    "bool?",
)
_DATA_FIELDS: dict[str, tuple[tuple[str, str], ...]] = {
    "episode.started": (("task_digest", _STR), ("deadline_s", _OPT_NUMBER)),
    "step.started": (("owner", _STR), ("stage", _OPT_STR), ("mode", _OPT_STR)),
    "step.boundary": (("owner", _STR), ("stage", _STR), ("next", _OPT_STR)),
    "ledger.row": (
        ("call_id", _STR),
        ("parent_call_id", _OPT_STR),
        ("fingerprint", _STR),
        ("context_digest", _STR),
        ("policy_version", _INT),
        ("prev_len", _INT),
        ("cum_len", _INT),
        ("digest", _STR),
        ("staging_key", _OPT_STR),
        ("constrained", _OPT_BOOL),
    ),
    "generation.chunk": (
        ("call_id", _STR),
        ("parent_call_id", _OPT_STR),
        ("request_digest", _STR),
        ("start", _INT),
        ("policy_version", _INT),
        ("staging_key", _OPT_STR),
        ("done", _OPT_BOOL),
    ),
    "session.started": (("session_id", _STR), ("mode", _OPT_STR), ("verify", _OPT_STR)),
    "session.state": (("session_id", _STR),),
    "session.ended": (("session_id", _STR),),
    "episode.finished": (("reward", _OPT_NUMBER),),
    "checkpoint.marker": (("checkpoint_id", _INT), ("controller_epoch", _INT)),
    "attempt.started": (
        ("restore_id", _INT),
        ("checkpoint_id", _INT),
        ("previous_attempt", _INT),
        ("cut", _INT),
    ),
}


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool is an int subclass, and never a seq or an offset


def _wrong(value: Any, kind: str) -> bool:
    if kind == _STR:
        return type(value) is not str
    if kind == _INT:
        return not _is_int(value)
    if value is None:
        return False
    if kind == _OPT_STR:
        return type(value) is not str
    if kind == _OPT_INT:
        return not _is_int(value)
    if kind == _OPT_NUMBER:
        return not isinstance(value, _NUMBER) or isinstance(value, bool)
    return type(value) is not bool


#: Episode ids repeat in every record of their episode: check each once.
_episode_problem = lru_cache(maxsize=1 << 16)(episode_id_problem)


_NUMBER_TYPES: frozenset[type] = frozenset({int, float})


def _opt_str(value: Any) -> bool:
    return value is None or type(value) is str


#: Per event type, its ``data`` check as one expression (the fast path: a loop over
#: ``_DATA_FIELDS`` costs the projector as much as decoding the record); ``_problem`` names the
#: field when it fails.
_DATA_CHECKS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "episode.started": lambda d: (
        type(d.get("task_digest")) is str
        and (d.get("deadline_s") is None or type(d.get("deadline_s")) in _NUMBER_TYPES)
    ),
    "step.started": lambda d: (
        type(d.get("owner")) is str and _opt_str(d.get("stage")) and _opt_str(d.get("mode"))
    ),
    "step.boundary": lambda d: (
        type(d.get("owner")) is str and type(d.get("stage")) is str and _opt_str(d.get("next"))
    ),
    "ledger.row": lambda d: (
        type(d.get("call_id")) is str
        and type(d.get("fingerprint")) is str
        and type(d.get("context_digest")) is str
        and type(d.get("digest")) is str
        and type(d.get("policy_version")) is int
        and type(d.get("prev_len")) is int
        and type(d.get("cum_len")) is int
        and _opt_str(d.get("parent_call_id"))
        and _opt_str(d.get("staging_key"))
        and (d.get("constrained") is None or type(d.get("constrained")) is bool)
    ),
    "generation.chunk": lambda d: (
        type(d.get("call_id")) is str
        and type(d.get("request_digest")) is str
        and type(d.get("start")) is int
        and type(d.get("policy_version")) is int
        and _opt_str(d.get("parent_call_id"))
        and _opt_str(d.get("staging_key"))
        and (d.get("done") is None or type(d.get("done")) is bool)
    ),
    "session.started": lambda d: (
        type(d.get("session_id")) is str and _opt_str(d.get("mode")) and _opt_str(d.get("verify"))
    ),
    "session.state": lambda d: type(d.get("session_id")) is str,
    "session.ended": lambda d: type(d.get("session_id")) is str,
    "episode.finished": lambda d: d.get("reward") is None or type(d.get("reward")) in _NUMBER_TYPES,
    "checkpoint.marker": lambda d: (
        type(d.get("checkpoint_id")) is int and type(d.get("controller_epoch")) is int
    ),
    "attempt.started": lambda d: (
        type(d.get("restore_id")) is int
        and type(d.get("checkpoint_id")) is int
        and type(d.get("previous_attempt")) is int
        and type(d.get("cut")) is int
    ),
}


def metadata_problem(meta: Any) -> str | None:
    """Why a record's decoded metadata cannot be folded, or None when it can."""
    if type(meta) is dict:
        kind = meta.get("type")
        data = meta.get("data")
        who = meta.get("participant")
        check = _DATA_CHECKS.get(kind) if type(kind) is str else None
        if (
            check is not None
            and type(data) is dict
            and type(who) is dict
            and type(meta.get("seq")) is int
            and type(meta.get("attempt")) is int
            and type(meta.get("ts")) in _NUMBER_TYPES
            and type(who.get("id")) is str
            and type(who.get("epoch")) is int
            and type(who.get("kind")) is str
            and check(data)
        ):
            if kind == "checkpoint.marker":
                return None
            episode = meta.get("episode")
            if type(episode) is str and _episode_problem(episode) is None:
                return None
    return _problem(meta)


def _problem(meta: Any) -> str | None:
    """The slow path: name what is wrong."""
    if type(meta) is not dict:
        return f"the record is JSON but not an object ({type(meta).__name__})"
    kind = meta.get("type")
    if type(kind) is not str:
        return "the record has no event type" if kind is None else "its type is not a string"
    fields = _DATA_FIELDS.get(kind)
    if fields is None:
        return f"unknown event type {kind[:64]!r}"
    data = meta.get("data")
    if type(data) is not dict:
        return f"{kind}: data is not an object"
    participant = meta.get("participant")
    if (
        type(participant) is not dict
        or type(participant.get("id")) is not str
        or not _is_int(participant.get("epoch"))
        or type(participant.get("kind")) is not str
    ):
        return f"{kind}: participant must be an object with a string id and kind, an int epoch"
    if not _is_int(meta.get("seq")) or not _is_int(meta.get("attempt")):
        return f"{kind}: seq and attempt must be integers"
    ts = meta.get("ts")
    if not isinstance(ts, _NUMBER) or isinstance(ts, bool):
        return f"{kind}: ts must be a number"
    if kind != "checkpoint.marker":
        episode = meta.get("episode")
        if type(episode) is not str:
            return f"{kind}: episode must be a string"
        problem = _episode_problem(episode)
        if problem is not None:
            return f"{kind}: episode id {episode[:64]!r} {problem}"
    for name, field_kind in fields:
        if _wrong(data.get(name), field_kind):
            return f"{kind}: data.{name} has the wrong type"
    return None
