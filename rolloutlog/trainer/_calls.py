"""The requests both trainer clients send, built once: ``Calls`` (the base of
``AsyncTrainerClient`` and ``TrainerClient``) turns each call's arguments into a ``Call`` (method,
path, query, body, timeout) and holds what the two share: the service URLs and the failover
between them, the token's headers, the controller epochs taken over and the staging keys seen.
The clients only send (``_send``, ``_lines``) and shape the answers.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import orjson

from rolloutlog.errors import InvalidRequest, RolloutlogError
from rolloutlog.trainer._failover import (
    Rounds,
    ServiceUrls,
    movable_error,
    movable_transport,
)
from rolloutlog.trainer._types import (
    StagingKeys,
    error_from_body,
)
from rolloutlog.wire import service_urls

__all__ = [
    "EPISODES_PER_CALL",
    "Call",
    "Calls",
    "CheckpointRef",
    "fork_call",
    "ndjson_line",
    "query",
]

CheckpointRef = int | Literal["latest"]
#: Episode ids named in one results request (they travel in its URL).
EPISODES_PER_CALL = 100


@dataclass(frozen=True, slots=True)
class Call:
    method: str
    path: str
    params: Mapping[str, Any] | None = None
    json: Any = None
    ndjson: bool = False
    #: This request's own timeout (None: the client's).
    timeout_s: float | None = None

    @property
    def timeout(self) -> Any:
        return httpx.USE_CLIENT_DEFAULT if self.timeout_s is None else self.timeout_s


def query(**values: Any) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


def fork_call(
    run: str,
    source: str,
    checkpoint_id: int | str,
    episodes: Sequence[str] | None,
    exclude: Sequence[str] | None,
) -> Call:
    """``POST /v1/runs`` creating ``run`` as a fork of ``source``'s committed checkpoint."""
    fork = query(
        run=source,
        checkpoint_id=checkpoint_id,
        episodes=None if episodes is None else list(episodes),
        exclude=None if exclude is None else list(exclude),
    )
    return Call("POST", "/v1/runs", json={"run": run, "fork": fork})


def ndjson_line(raw: bytes | memoryview | str) -> Any:
    """One NDJSON line; an in-band ``{"error": …}`` line is raised."""
    value = orjson.loads(raw)
    if isinstance(value, dict) and set(value) == {"error"}:
        raise error_from_body(200, value)
    return value


class Calls:
    """The requests both clients send (built here once)."""

    def __init__(
        self,
        url: str | Sequence[str] | None,
        token: str | None,
        given_client: bool,
        failover_s: float,
    ) -> None:
        urls = service_urls(url)
        #: The first service URL (the only one, unless several were given).
        self.url = urls[0]
        #: Several URLs: each call's own (``_base``); one: the client's base URL, as always.
        self._urls = ServiceUrls(urls) if len(urls) > 1 else None
        self.failover_s = failover_s
        # An injected client may have no base URL: prefix paths with ``url`` when one is given.
        self._prefix = "" if not given_client or url is None else self.url
        self._headers = _headers(token)
        self.controller_epochs: dict[str, int] = {}
        self._staging = StagingKeys()

    @property
    def urls(self) -> tuple[str, ...]:
        """Every service URL this client may call."""
        return self._urls.urls if self._urls is not None else (self.url,)

    def _base(self) -> str:
        return self._urls.current if self._urls is not None else self._prefix

    def _moved(self, rounds: Rounds, error: BaseException) -> float:
        """A call failed at the current URL: move on (how long to pause first), or re-raise
        ``error`` once the call's time is up."""
        assert self._urls is not None
        if rounds.expired():
            raise error
        return rounds.pause_s(self._urls.advance())

    def _movable(self, error: BaseException, method: str) -> bool:
        if self._urls is None:
            return False
        if isinstance(error, httpx.TransportError):
            return movable_transport(error, method)
        return isinstance(error, RolloutlogError) and movable_error(error, method)

    def _epoch(self, run: str, controller_epoch: int | None) -> int:
        if controller_epoch is not None:
            return controller_epoch
        try:
            return self.controller_epochs[run]
        except KeyError:
            raise InvalidRequest(
                f"no controller epoch for run {run!r}: call take_over() first or pass one",
                run=run,
            ) from None

    def _checkpoint_call(
        self,
        run: str,
        epoch: int,
        deadline_s: float | None,
        wait: bool,
        trigger: str,
        request_id: str,
    ) -> Call:
        body: dict[str, Any] = {
            "controller_epoch": epoch,
            "wait": wait,
            "trigger": trigger,
            "request_id": request_id,
        }
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        since = self._staging.since(run)
        if since is not None:
            body["staging_keys_since"] = since
        return Call("POST", f"/v1/runs/{run}/checkpoints", json=body)

    @staticmethod
    def _restore_call(
        run: str,
        epoch: int,
        checkpoint_id: CheckpointRef,
        exclude: Iterable[str],
        policy_version: int | None,
        max_policy_lag: int | None,
        exclude_results: bool = False,
    ) -> Call:
        body: dict[str, Any] = {
            "controller_epoch": epoch,
            "checkpoint_id": checkpoint_id,
            "exclude": list(exclude),
        }
        if exclude_results:
            body["exclude_results"] = True
        if policy_version is not None:
            body["policy_version"] = policy_version
        if max_policy_lag is not None:
            body["max_policy_lag"] = max_policy_lag
        return Call("POST", f"/v1/runs/{run}/restores", json=body)

    @staticmethod
    def _results_calls(
        run: str, since_checkpoint: int | None, episodes: Iterable[str] | None, unacknowledged: bool
    ) -> list[Call]:
        """One call, or one per ``EPISODES_PER_CALL`` named episodes (a URL stays short)."""
        params = query(
            since_checkpoint=since_checkpoint, unacknowledged="true" if unacknowledged else None
        )
        path = f"/v1/runs/{run}/results"
        if episodes is None:
            return [Call("GET", path, params)]
        names = sorted(set(episodes))
        return [
            Call("GET", path, {**params, "episodes": ",".join(names[i : i + EPISODES_PER_CALL])})
            for i in range(0, len(names), EPISODES_PER_CALL)
        ]

    @staticmethod
    def _ack_call(run: str, episodes: Iterable[str]) -> Call | None:
        names = sorted(set(episodes))
        if not names:
            return None
        return Call("POST", f"/v1/runs/{run}/results/ack", json={"episodes": names})

    @staticmethod
    def _requested_call(run: str, request_id: str) -> Call:
        """The checkpoint begun for ``request_id`` (the newest: the others were aborted)."""
        return Call("GET", f"/v1/runs/{run}/checkpoints", query(request_id=request_id, limit=1))

    @staticmethod
    def _checkpoint_path(run: str, checkpoint_id: CheckpointRef) -> str:
        return f"/v1/runs/{run}/checkpoints/{checkpoint_id}"

    @staticmethod
    def _restores_call(run: str, limit: int) -> Call:
        return Call("GET", f"/v1/runs/{run}/restores", query(limit=limit))

    @staticmethod
    def _history_call(run: str, episode: str, after: int | None, limit: int | None) -> Call:
        path = f"/v1/runs/{run}/episodes/{episode}"
        return Call("GET", path, query(after=after, limit=limit))

    @staticmethod
    def _quarantine_call(run: str, after: str | None, limit: int | None) -> Call:
        return Call("GET", f"/v1/runs/{run}/quarantine", query(after=after, limit=limit))

    @staticmethod
    def _projection_call(
        run: str, episode: str, restore: CheckpointRef | None, checkpoint: int | None
    ) -> Call:
        return Call(
            "GET",
            f"/v1/runs/{run}/episodes/{episode}/projection",
            query(restore=restore, checkpoint=checkpoint),
        )


def _headers(token: str | None) -> dict[str, str]:
    token = token if token is not None else os.environ.get("ROLLOUTLOG_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}
