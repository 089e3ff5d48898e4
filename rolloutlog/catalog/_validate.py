"""Input checks shared by the catalog's operations (all raise ``InvalidRequest``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rolloutlog.catalog._schema import NAME_LENGTH
from rolloutlog.errors import InvalidRequest
from rolloutlog.log import check_run_name as check_run_name
from rolloutlog.log import episode_id_problem


def check_name(value: str, what: str, length: int = NAME_LENGTH) -> None:
    if not isinstance(value, str) or not value or len(value) > length:
        raise InvalidRequest(f"{what} must be a string of 1-{length} characters", field=what)


def check_episode(episode: str) -> None:
    """An episode id: a name that does not itself look like a capture key (``r17-a2``)."""
    check_name(episode, "episode")
    problem = episode_id_problem(episode)
    if problem is not None:
        raise InvalidRequest(
            f"invalid episode id {episode!r}: {problem}", field="episode", episode=episode
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
