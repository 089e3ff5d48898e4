"""The digests a participant writes and a restore recomputes (docs/design.md §3): defined once,
for the SDK and the service alike, so that the two can never disagree on what they mean."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import orjson

from rolloutlog.core._opaque import Opaque

__all__ = ["ledger_digest", "task_digest", "token_count"]


def ledger_digest(parent_digest: str, token_ids: Iterable[int] | bytes) -> str:
    """sha256 of ``parent_digest + ":" + ",".join(tokens)``.

    ``token_ids`` are the ids, or (``bytes``) their JSON array as a record holds it, hashed without
    decoding: orjson writes an int array as ``[1,2,3]``, so its inside is exactly the joined text.
    """
    if isinstance(token_ids, bytes):
        inside = token_ids.strip()[1:-1].replace(b" ", b"")
        return hashlib.sha256(parent_digest.encode() + b":" + inside).hexdigest()
    text = parent_digest + ":" + ",".join(map(str, token_ids))
    return hashlib.sha256(text.encode()).hexdigest()


def task_digest(task: Any) -> str:
    """sha256 of the task's canonical JSON (sorted keys, compact).

    ``task`` is a JSON value, an ``Opaque``, or (``bytes`` or a view) its raw JSON as a record
    holds it.
    """
    if isinstance(task, Opaque):
        raw = task.raw
    elif isinstance(task, bytes | memoryview):
        raw = task
    else:
        raw = orjson.dumps(task)
    return hashlib.sha256(orjson.dumps(orjson.loads(raw), option=orjson.OPT_SORT_KEYS)).hexdigest()


def token_count(token_ids_json: bytes) -> int:
    """How many ids a JSON int array holds, counted without decoding it."""
    inside = token_ids_json.strip()[1:-1].strip()
    return 0 if not inside else inside.count(b",") + 1
