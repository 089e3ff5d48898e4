"""Input checks shared by the catalog's operations (all raise ``InvalidRequest``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rolloutlog.catalog._schema import NAME_LENGTH
from rolloutlog.errors import InvalidRequest

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
_ATTEMPT_SUFFIX = re.compile(r"-a[0-9]+")


def check_run_name(run: str) -> None:
    if not isinstance(run, str) or len(run) > NAME_LENGTH or not _RUN_NAME.fullmatch(run):
        raise InvalidRequest(
            f"run name {run!r} must be 1-{NAME_LENGTH} characters of letters, digits and ._:- "
            "starting with a letter or digit",
            field="run",
        )


def check_name(value: str, what: str, length: int = NAME_LENGTH) -> None:
    if not isinstance(value, str) or not value or len(value) > length:
        raise InvalidRequest(f"{what} must be a string of 1-{length} characters", field=what)


def check_episode(episode: str) -> None:
    """An episode id: a name that does not itself look like a capture key (``r17-a2``)."""
    check_name(episode, "episode")
    if "-a" in episode:
        tail = episode[episode.rfind("-a") :]
        if _ATTEMPT_SUFFIX.fullmatch(tail):
            raise InvalidRequest(
                f"episode id {episode!r} may not end in -a<digits>: that is a capture key",
                field="episode",
                episode=episode,
            )


def check_count(value: Any, what: str, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRequest(f"{what} must be an integer >= {minimum}, not {value!r}", field=what)


def check_positive_seconds(value: float | None, what: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidRequest(f"{what} must be a positive number of seconds", field=what)


def check_timings(timings_ms: Mapping[str, float] | None) -> None:
    if timings_ms is None:
        return
    for name, value in timings_ms.items():
        if (
            not isinstance(name, str)
            or isinstance(value, bool)
            or not isinstance(value, int | float)
        ):
            raise InvalidRequest("timings_ms maps names to milliseconds", field="timings_ms")
