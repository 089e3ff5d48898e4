"""Trainer-side REST clients of the service: ``AsyncTrainerClient`` (``_async_client``) and
``TrainerClient`` (sync, here), twins on the requests of ``_calls``.

Both take an optional ``httpx`` client, so tests can run them against the app in process
(``httpx.ASGITransport``) as well as against a real server. The URL and token default to
``ROLLOUTLOG_URL`` and ``ROLLOUTLOG_TOKEN``. Error replies are raised as rolloutlog's own errors
(``StaleController``, ``UnknownCheckpoint``…), so callers catch the same classes in process and
over HTTP. Several URLs (replicas of one service, a list or a comma-separated string): a call
moves to the next on a transport error or a retriable refusal, by the rules of ``_failover.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, Self

import httpx
import orjson

from rolloutlog._telemetry import client_span
from rolloutlog.errors import CheckpointInProgress, RolloutlogError
from rolloutlog.trainer._calls import (
    Call,
    Calls,
    CheckpointRef,
    fork_call,
    ndjson_line,
    query,
)
from rolloutlog.trainer._failover import (
    POLL_S,
    CheckpointAttempt,
    Rounds,
    checkpoint_answer_s,
    checkpoint_budget_s,
    movable_error,
    movable_transport,
)
from rolloutlog.trainer._types import (
    CheckpointInfo,
    EpisodeResult,
    RestoreEpisode,
    RestoreInfo,
    error_from_response,
)
from rolloutlog.wire import CLIENT_KEEPALIVE_S, DEFAULT_URL, NDJSON, NdjsonSplitter

__all__ = ["DEFAULT_URL", "TrainerClient"]


class TrainerClient(Calls):
    """The same calls as ``AsyncTrainerClient``, blocking (for scripts and the CLI)."""

    def __init__(
        self,
        url: str | Sequence[str] | None = None,
        *,
        token: str | None = None,
        client: httpx.Client | None = None,
        timeout_s: float = 300.0,
        failover_s: float = 30.0,
    ) -> None:
        super().__init__(url, token, client is not None, failover_s)
        self._owns_client = client is None
        base = self.url if self._urls is None else ""
        self.timeout_s = timeout_s
        self._client = client or httpx.Client(
            base_url=base,
            timeout=timeout_s,
            limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S),
        )

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _send_once(self, call: Call) -> Any:
        with client_span(call.method, call.path, self._headers) as headers:
            response = self._client.request(
                call.method,
                self._base() + call.path,
                params=call.params,
                json=call.json,
                headers=headers,
                timeout=call.timeout,
            )
        if response.is_error:
            raise error_from_response(response)
        return orjson.loads(response.content)

    def _send(self, call: Call) -> Any:
        rounds = Rounds(self.failover_s)
        while True:
            try:
                return self._send_once(call)
            except (httpx.TransportError, RolloutlogError) as e:
                if not self._movable(e, call.method):
                    raise
                pause = self._moved(rounds, e)
            time.sleep(pause)

    def _lines(self, call: Call) -> Iterator[Any]:
        accept = {**self._headers, "Accept": NDJSON}
        rounds = Rounds(self.failover_s)
        while True:
            streaming = False
            try:
                with (
                    client_span(call.method, call.path, accept) as headers,
                    self._client.stream(
                        call.method, self._base() + call.path, params=call.params, headers=headers
                    ) as response,
                ):
                    if response.is_error:
                        response.read()
                        raise error_from_response(response)
                    streaming = True  # from here on an error is the caller's
                    lines = NdjsonSplitter()
                    for chunk in response.iter_bytes():
                        for line in lines.feed(chunk):
                            yield ndjson_line(line)
                    for line in lines.end():
                        yield ndjson_line(line)
                return
            except (httpx.TransportError, RolloutlogError) as e:
                if streaming or not self._movable(e, call.method):
                    raise
                pause = self._moved(rounds, e)
            time.sleep(pause)

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._send(Call("GET", "/readyz"))
        return result

    def create_run(self, run: str, partitions: int | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self._send(
            Call("POST", "/v1/runs", json=query(run=run, partitions=partitions))
        )
        return result

    def fork_run(
        self,
        run: str,
        source: str,
        checkpoint_id: int | str = "latest",
        *,
        episodes: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """``AsyncTrainerClient.fork_run`` (the reply's ``staging_keys``: those of the fork's
        checkpoint 1)."""
        call = fork_call(run, source, checkpoint_id, episodes, exclude)
        result: dict[str, Any] = self._send(call)
        return result

    def get_run(self, run: str) -> dict[str, Any]:
        result: dict[str, Any] = self._send(Call("GET", f"/v1/runs/{run}"))
        return result

    def delete_run(self, run: str) -> dict[str, Any]:
        """Delete the run: its log, catalog rows and the service's resources for it."""
        result: dict[str, Any] = self._send(Call("DELETE", f"/v1/runs/{run}"))
        self.controller_epochs.pop(run, None)
        return result

    def list_runs(self) -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = []
        after: str | None = None
        while True:
            page = self._send(Call("GET", "/v1/runs", query(after=after, limit=500)))
            runs.extend(page["runs"])
            after = page.get("next_after")
            if after is None:
                return runs

    def register_participant(self, run: str, participant_id: str, kind: str) -> int:
        body = {"id": participant_id, "kind": kind}
        return int(self._send(Call("POST", f"/v1/runs/{run}/participants", json=body))["epoch"])

    def take_over(self, run: str, *, expected_epoch: int | None = None) -> int:
        body = query(expected_epoch=expected_epoch)
        result = self._send(Call("POST", f"/v1/runs/{run}/controller", json=body))
        epoch = int(result["controller_epoch"])
        self.controller_epochs[run] = epoch
        return epoch

    def stats(self, run: str) -> dict[str, Any]:
        result: dict[str, Any] = self._send(Call("GET", f"/v1/runs/{run}/stats"))
        return result

    def participants(self, run: str) -> list[dict[str, Any]]:
        """The run's registered participants: id, kind, epoch, registered and last seen."""
        body = self._send(Call("GET", f"/v1/runs/{run}/participants"))
        return list(body["participants"])

    def quarantine(
        self, run: str, *, after: str | None = None, limit: int | None = None
    ) -> dict[str, Any]:
        """One page of the run's quarantined records (see ``AsyncTrainerClient.quarantine``)."""
        result: dict[str, Any] = self._send(self._quarantine_call(run, after, limit))
        return result

    def projector(self, run: str) -> dict[str, Any]:
        """How far this service's projector trails the run's log, per partition."""
        result: dict[str, Any] = self._send(Call("GET", f"/v1/runs/{run}/projector"))
        return result

    def episodes(self, run: str, *, status: str | None = None) -> Iterator[Any]:
        return self._lines(Call("GET", f"/v1/runs/{run}/episodes", query(status=status)))

    def checkpoint(
        self,
        run: str,
        *,
        controller_epoch: int | None = None,
        deadline_s: float | None = None,
        wait: bool = True,
        trigger: str = "request",
        request_id: str | None = None,
    ) -> CheckpointInfo:
        """As ``AsyncTrainerClient.checkpoint``."""
        epoch = self._epoch(run, controller_epoch)
        attempt = CheckpointAttempt.begin(request_id)
        if self._urls is None:
            call = self._checkpoint_call(run, epoch, deadline_s, wait, trigger, attempt.request_id)
            return self._staging.info(run, self._send(call))
        rounds = Rounds(checkpoint_budget_s(deadline_s))
        while True:
            try:
                if attempt.unanswered:  # was it taken? the catalog knows
                    requested = self._requested_call(run, attempt.request_id)
                    found = attempt.taken(self._send_once(requested)["checkpoints"], wait)
                    if found is not None:
                        return self._staging.info(run, found)
                call = self._checkpoint_call(
                    run, epoch, deadline_s, wait, trigger, attempt.request_id
                )
                call = replace(call, timeout_s=min(self.timeout_s, checkpoint_answer_s(deadline_s)))
                return self._staging.info(run, self._send_once(call))
            except CheckpointInProgress as e:
                pause = self._moved(rounds, e) if rounds.expired() else POLL_S
            except httpx.TransportError as e:
                attempt.unanswered |= not movable_transport(e, "POST")
                pause = self._moved(rounds, e)
            except RolloutlogError as e:
                if not movable_error(e, "POST"):
                    raise
                pause = self._moved(rounds, e)
            time.sleep(pause)

    def get_checkpoint(self, run: str, checkpoint_id: CheckpointRef) -> CheckpointInfo:
        return CheckpointInfo.from_json(
            self._send(Call("GET", self._checkpoint_path(run, checkpoint_id)))
        )

    def wait_for_checkpoint(
        self, run: str, checkpoint_id: int, *, poll_s: float = 0.25, timeout_s: float | None = None
    ) -> CheckpointInfo:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            info = self.get_checkpoint(run, checkpoint_id)
            if info.status != "pending" or (deadline is not None and time.monotonic() > deadline):
                return info
            time.sleep(poll_s)

    def list_checkpoints(
        self, run: str, *, status: str | None = None, limit: int = 100
    ) -> list[CheckpointInfo]:
        call = Call("GET", f"/v1/runs/{run}/checkpoints", query(status=status, limit=limit))
        return [CheckpointInfo.from_json(c) for c in self._send(call)["checkpoints"]]

    def manifest(self, run: str, checkpoint_id: int) -> Iterator[Any]:
        return self._lines(Call("GET", self._checkpoint_path(run, checkpoint_id) + "/manifest"))

    def results(
        self,
        run: str,
        *,
        since_checkpoint: int | None = None,
        episodes: Iterable[str] | None = None,
        unacknowledged: bool = False,
    ) -> list[EpisodeResult]:
        """As ``AsyncTrainerClient.results``."""
        return [
            EpisodeResult.from_json(item)
            for call in self._results_calls(run, since_checkpoint, episodes, unacknowledged)
            for item in self._lines(call)
        ]

    def ack_results(self, run: str, episodes: Iterable[str]) -> int:
        """As ``AsyncTrainerClient.ack_results``."""
        call = self._ack_call(run, episodes)
        return 0 if call is None else int(self._send(call)["acknowledged"])

    def restore(
        self,
        run: str,
        *,
        checkpoint_id: CheckpointRef = "latest",
        exclude: Iterable[str] = (),
        policy_version: int | None = None,
        max_policy_lag: int | None = None,
        controller_epoch: int | None = None,
        exclude_results: bool = False,
    ) -> RestoreInfo:
        """Restore a committed checkpoint. ``exclude_results``: also exclude the episodes whose
        finished result the service holds (read them with ``results``)."""
        call = self._restore_call(
            run,
            self._epoch(run, controller_epoch),
            checkpoint_id,
            exclude,
            policy_version,
            max_policy_lag,
            exclude_results,
        )
        return RestoreInfo.from_json(self._send(call))

    def get_restore(self, run: str, restore_id: int) -> RestoreInfo:
        return RestoreInfo.from_json(
            self._send(Call("GET", f"/v1/runs/{run}/restores/{restore_id}"))
        )

    def list_restores(self, run: str, *, limit: int = 100) -> list[RestoreInfo]:
        """The run's restores, newest first (without their episodes)."""
        body = self._send(self._restores_call(run, limit))
        return [RestoreInfo.from_json(r) for r in body["restores"]]

    def episode_history(
        self, run: str, episode: str, *, after: int | None = None, limit: int | None = None
    ) -> dict[str, Any]:
        """One episode across attempts (see ``AsyncTrainerClient.episode_history``)."""
        result: dict[str, Any] = self._send(self._history_call(run, episode, after, limit))
        return result

    def restore_episodes(
        self, run: str, restore_id: int, *, action: str | None = None
    ) -> Iterator[RestoreEpisode]:
        call = Call("GET", f"/v1/runs/{run}/restores/{restore_id}/episodes", query(action=action))
        return (RestoreEpisode.from_json(item) for item in self._lines(call))

    def projection(
        self,
        run: str,
        episode: str,
        *,
        restore: CheckpointRef | None = None,
        checkpoint: int | None = None,
    ) -> dict[str, Any]:
        result: dict[str, Any] = self._send(
            self._projection_call(run, episode, restore, checkpoint)
        )
        return result

    def projections(
        self, run: str, restore_id: int, *, kind: str | None = None, participant: str | None = None
    ) -> Iterator[Any]:
        call = Call(
            "GET",
            f"/v1/runs/{run}/restores/{restore_id}/projections",
            query(kind=kind, participant=participant),
        )
        return self._lines(call)
