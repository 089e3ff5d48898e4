"""Identifiers: runs, episodes, participants and capture keys (docs/design.md §1)."""

from __future__ import annotations

import re
from functools import lru_cache

#: For pydantic (whose Rust regex ``$`` matches only at the very end). Python's ``re`` also lets
#: ``$`` match before a trailing newline, so Python code must ``fullmatch`` (``_NAME``), never
#: ``match``: an id ending in a newline was once accepted and then could never be fetched.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$"
_NAME = re.compile(NAME_PATTERN.removeprefix("^").removesuffix("$"))
_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_ATTEMPT_SUFFIX = re.compile(r"-a\d+\Z")
_CAPTURE_KEY = re.compile(r"(.+?)(?:-a(\d+))?")


def episode_id_problem(episode: str) -> str | None:
    """Why ``episode`` is not a valid episode id, or None when it is."""
    if not _NAME.fullmatch(episode):
        return "must be 1-200 characters of letters, digits and '._:-', starting alphanumeric"
    if _ATTEMPT_SUFFIX.search(episode):
        return "may not end in '-a<digits>' (that suffix names an attempt)"
    return None


def name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid participant id or session id, or None when it is."""
    if not _NAME.fullmatch(name):
        return "must be 1-200 characters of letters, digits and '._:-', starting alphanumeric"
    return None


def run_name_problem(run: str) -> str | None:
    """Why ``run`` is not a valid run name (it names a Kafka topic), or None when it is."""
    if not _RUN.fullmatch(run):
        return "must be 1-100 characters of letters, digits and '._-', starting alphanumeric"
    return None


def capture_key(episode: str, attempt: int) -> str:
    """``r17`` for attempt 0, ``r17-a2`` for attempt 2."""
    return episode if attempt == 0 else f"{episode}-a{attempt}"


def parse_capture_key(key: str) -> tuple[str, int]:
    """Split a capture key into (episode, attempt); raises ValueError when it is not one."""
    match = _CAPTURE_KEY.fullmatch(key)
    if match is None:
        raise ValueError(f"not a capture key: {key!r}")
    episode, attempt = match.group(1), match.group(2)
    if episode_id_problem(episode) is not None:
        raise ValueError(f"not a capture key: {key!r}")
    if attempt is None:
        return episode, 0
    if int(attempt) == 0 or attempt.startswith("0"):
        raise ValueError(f"not a capture key: {key!r} (attempt 0 has no suffix)")
    return episode, int(attempt)


def _murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash, so episode keys land where a Java or aiokafka producer puts them."""
    length = len(data)
    seed = 0x9747B28C
    m = 0x5BD1E995
    h = (seed ^ length) & 0xFFFFFFFF
    full = length - (length % 4)
    for i in range(0, full, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    rest = length % 4
    if rest == 3:
        h ^= data[full + 2] << 16
    if rest >= 2:
        h ^= data[full + 1] << 8
    if rest >= 1:
        h ^= data[full]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


@lru_cache(maxsize=1 << 16)
def partition_for(episode: str, partitions: int) -> int:
    """The partition of an episode's events: Kafka's default key partitioner (murmur2)."""
    return (_murmur2(episode.encode()) & 0x7FFFFFFF) % partitions
