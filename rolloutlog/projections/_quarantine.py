"""Which log records the projector cannot take: not a rolloutlog envelope, or metadata of the wrong
shape where the fold reads it.

Anyone on the direct Kafka path can produce into a run's topic, so the projector checks what it
reads instead of trusting it. The check covers the envelope fields the tracker reads and every
metadata field of the type's ``data`` (a full pydantic validation of every record would cost the
projector most of its speed), so a record that passes cannot poison the per-episode state that
later good records are folded into (a ``seq`` that is a string, say, would make every later
comparison of that participant raise).

The check is the envelope checker's (``core.record_holds``, built from the models' shapes
like the append's and the SDK's): the envelope fields the tracker reads, and each metadata field
of the type's ``data`` by its JSON type: a required field must be there (None only where the model
allows it); a field with a default may be left out (the fold reads the default) but, if there, has
the model's type (None only where the model allows it). It only accepts; a record it does not
take goes to ``_problem``, which names the problem, so the verdicts are ``_problem``'s (tested on
every single mutation of each type). The model is the contract, so a record that breaks it is a
bad record: this quarantines a ``step.started`` without a string ``stage`` (the fold reads
``data["stage"]``), a null ``mode``/``verify``/``constrained``/``done``, a ``parent_call_id`` left
out, and a ``session.state`` whose ``checkpoint_id`` is neither an int nor null (the fold keeps it
as the export's checkpoint). The values' constraints (name patterns, digest lengths, bounds,
choices) stay the append's: a wrong value there does not make the fold raise.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from rolloutlog.core import (
    DATA_SHAPES,
    episode_id_problem,
    record_holds,
    wrong_record_field,
)

__all__ = ["metadata_problem"]

_NUMBER = (int, float)

#: Episode ids repeat in every record of their episode: check each once.
_episode_problem = lru_cache(maxsize=1 << 16)(episode_id_problem)


def _is_int(value: Any) -> bool:
    return type(value) is int


def metadata_problem(meta: Any) -> str | None:
    """Why a record's decoded metadata cannot be folded, or None when it can."""
    if record_holds(meta):
        return None
    return _problem(meta)


def _problem(meta: Any) -> str | None:
    """The slow path: name what is wrong."""
    if type(meta) is not dict:
        return f"the record is JSON but not an object ({type(meta).__name__})"
    kind = meta.get("type")
    if type(kind) is not str:
        return "the record has no event type" if kind is None else "its type is not a string"
    if kind not in DATA_SHAPES:
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
    wrong = wrong_record_field(kind, data)
    if wrong is not None:
        return f"{kind}: data.{wrong} has the wrong type"
    return None
