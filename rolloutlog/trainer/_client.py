"""Trainer-side REST clients of the service: ``AsyncTrainerClient`` and ``TrainerClient`` (sync).

Both take an optional ``httpx`` client, so tests can run them against the app in process
(``httpx.ASGITransport``) as well as against a real server. The URL and token default to
``ROLLOUTLOG_URL`` and ``ROLLOUTLOG_TOKEN``. Error replies are raised as rolloutlog's own errors
(``StaleController``, ``UnknownCheckpoint``…), so callers catch the same classes in process and
over HTTP. Several URLs (replicas of one service, a list or a comma-separated string): a call
moves to the next on a transport error or a retriable refusal, by the rules of ``_failover.py``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Literal, Self

import httpx
import orjson

from rolloutlog._telemetry import client_span
from rolloutlog.errors import CheckpointInProgress, InvalidRequest, RolloutlogError
from rolloutlog.trainer._failover import (
    POLL_S,
    CheckpointAttempt,
    Rounds,
    ServiceUrls,
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
    StagingKeys,
    error_from_body,
    error_from_response,
)
from rolloutlog.wire import DEFAULT_URL, NDJSON, NdjsonSplitter, service_urls

__all__ = ["DEFAULT_URL", "AsyncTrainerClient", "TrainerClient"]

CheckpointRef = int | Literal["latest"]
#: Episode ids named in one results request (they travel in its URL).
_EPISODES_PER_CALL = 100


@dataclass(frozen=True, slots=True)
class _Call:
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


def _params(**values: Any) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


def _fork_call(
    run: str,
    source: str,
    checkpoint_id: int | str,
    episodes: Sequence[str] | None,
    exclude: Sequence[str] | None,
) -> _Call:
    """``POST /v1/runs`` creating ``run`` as a fork of ``source``'s committed checkpoint."""
    fork = _params(
        run=source,
        checkpoint_id=checkpoint_id,
        episodes=None if episodes is None else list(episodes),
        exclude=None if exclude is None else list(exclude),
    )
    return _Call("POST", "/v1/runs", json={"run": run, "fork": fork})


def _line(raw: bytes | str) -> Any:
    """One NDJSON line; an in-band ``{"error": …}`` line is raised."""
    value = orjson.loads(raw)
    if isinstance(value, dict) and set(value) == {"error"}:
        raise error_from_body(200, value)
    return value


class _Calls:
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
    ) -> _Call:
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
        return _Call("POST", f"/v1/runs/{run}/checkpoints", json=body)

    @staticmethod
    def _restore_call(
        run: str,
        epoch: int,
        checkpoint_id: CheckpointRef,
        exclude: Iterable[str],
        policy_version: int | None,
        max_policy_lag: int | None,
        exclude_results: bool = False,
    ) -> _Call:
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
        return _Call("POST", f"/v1/runs/{run}/restores", json=body)

    @staticmethod
    def _results_calls(
        run: str, since_checkpoint: int | None, episodes: Iterable[str] | None, unacknowledged: bool
    ) -> list[_Call]:
        """One call, or one per ``_EPISODES_PER_CALL`` named episodes (a URL stays short)."""
        params = _params(
            since_checkpoint=since_checkpoint, unacknowledged="true" if unacknowledged else None
        )
        path = f"/v1/runs/{run}/results"
        if episodes is None:
            return [_Call("GET", path, params)]
        names = sorted(set(episodes))
        return [
            _Call("GET", path, {**params, "episodes": ",".join(names[i : i + _EPISODES_PER_CALL])})
            for i in range(0, len(names), _EPISODES_PER_CALL)
        ]

    @staticmethod
    def _ack_call(run: str, episodes: Iterable[str]) -> _Call | None:
        names = sorted(set(episodes))
        if not names:
            return None
        return _Call("POST", f"/v1/runs/{run}/results/ack", json={"episodes": names})

    @staticmethod
    def _requested_call(run: str, request_id: str) -> _Call:
        """The checkpoint begun for ``request_id`` (the newest: the others were aborted)."""
        return _Call("GET", f"/v1/runs/{run}/checkpoints", _params(request_id=request_id, limit=1))

    @staticmethod
    def _checkpoint_path(run: str, checkpoint_id: CheckpointRef) -> str:
        return f"/v1/runs/{run}/checkpoints/{checkpoint_id}"

    @staticmethod
    def _restores_call(run: str, limit: int) -> _Call:
        return _Call("GET", f"/v1/runs/{run}/restores", _params(limit=limit))

    @staticmethod
    def _history_call(run: str, episode: str, after: int | None, limit: int | None) -> _Call:
        path = f"/v1/runs/{run}/episodes/{episode}"
        return _Call("GET", path, _params(after=after, limit=limit))

    @staticmethod
    def _quarantine_call(run: str, after: str | None, limit: int | None) -> _Call:
        return _Call("GET", f"/v1/runs/{run}/quarantine", _params(after=after, limit=limit))

    @staticmethod
    def _projection_call(
        run: str, episode: str, restore: CheckpointRef | None, checkpoint: int | None
    ) -> _Call:
        return _Call(
            "GET",
            f"/v1/runs/{run}/episodes/{episode}/projection",
            _params(restore=restore, checkpoint=checkpoint),
        )


def _headers(token: str | None) -> dict[str, str]:
    token = token if token is not None else os.environ.get("ROLLOUTLOG_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


class AsyncTrainerClient(_Calls):
    """Runs, controller takeover, checkpoints, restores, manifests and projections (async)."""

    def __init__(
        self,
        url: str | Sequence[str] | None = None,
        *,
        token: str | None = None,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = 300.0,
        failover_s: float = 30.0,
    ) -> None:
        super().__init__(url, token, client is not None, failover_s)
        self._owns_client = client is None
        base = self.url if self._urls is None else ""
        self.timeout_s = timeout_s
        self._client = client or httpx.AsyncClient(base_url=base, timeout=timeout_s)

    async def start(self) -> None:
        """Nothing to open (httpx connects lazily); here for the lifecycle's symmetry."""

    async def stop(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _send_once(self, call: _Call) -> Any:
        with client_span(call.method, call.path, self._headers) as headers:
            response = await self._client.request(
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

    async def _send(self, call: _Call) -> Any:
        rounds = Rounds(self.failover_s)
        while True:
            try:
                return await self._send_once(call)
            except (httpx.TransportError, RolloutlogError) as e:
                if not self._movable(e, call.method):
                    raise
                pause = self._moved(rounds, e)
            await asyncio.sleep(pause)

    async def _lines(self, call: _Call) -> AsyncIterator[Any]:
        accept = {**self._headers, "Accept": NDJSON}
        rounds = Rounds(self.failover_s)
        while True:
            streaming = False
            try:
                async with (
                    client_span(call.method, call.path, accept) as headers,
                    self._client.stream(
                        call.method, self._base() + call.path, params=call.params, headers=headers
                    ) as response,
                ):
                    if response.is_error:
                        await response.aread()
                        raise error_from_response(response)
                    streaming = True  # from here on an error is the caller's
                    lines = NdjsonSplitter()
                    async for chunk in response.aiter_bytes():
                        for line in lines.feed(chunk):
                            yield _line(line)
                    for line in lines.end():
                        yield _line(line)
                return
            except (httpx.TransportError, RolloutlogError) as e:
                if streaming or not self._movable(e, call.method):
                    raise
                pause = self._moved(rounds, e)
            await asyncio.sleep(pause)

    # -- runs ------------------------------------------------------------------------------

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(_Call("GET", "/readyz"))
        return result

    async def create_run(self, run: str, partitions: int | None = None) -> dict[str, Any]:
        body = _params(run=run, partitions=partitions)
        result: dict[str, Any] = await self._send(_Call("POST", "/v1/runs", json=body))
        return result

    async def fork_run(
        self,
        run: str,
        source: str,
        checkpoint_id: int | str = "latest",
        *,
        episodes: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Create ``run`` as a fork of ``source``'s committed checkpoint (its live episodes, or
        ``episodes``, minus ``exclude``); the reply's ``forked_from`` names the checkpoint. The
        same fork again answers as created; ``resume_run(run)`` then continues them."""
        call = _fork_call(run, source, checkpoint_id, episodes, exclude)
        result: dict[str, Any] = await self._send(call)
        return result

    async def get_run(self, run: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(_Call("GET", f"/v1/runs/{run}"))
        return result

    async def delete_run(self, run: str) -> dict[str, Any]:
        """Delete the run: its log, catalog rows and the service's resources for it."""
        result: dict[str, Any] = await self._send(_Call("DELETE", f"/v1/runs/{run}"))
        self.controller_epochs.pop(run, None)
        return result

    async def list_runs(self) -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = []
        after: str | None = None
        while True:
            page = await self._send(_Call("GET", "/v1/runs", _params(after=after, limit=500)))
            runs.extend(page["runs"])
            after = page.get("next_after")
            if after is None:
                return runs

    async def register_participant(self, run: str, participant_id: str, kind: str) -> int:
        body = {"id": participant_id, "kind": kind}
        result = await self._send(_Call("POST", f"/v1/runs/{run}/participants", json=body))
        return int(result["epoch"])

    async def take_over(self, run: str, *, expected_epoch: int | None = None) -> int:
        """Become the run's controller; later calls of this client use the new epoch."""
        body = _params(expected_epoch=expected_epoch)
        result = await self._send(_Call("POST", f"/v1/runs/{run}/controller", json=body))
        epoch = int(result["controller_epoch"])
        self.controller_epochs[run] = epoch
        return epoch

    async def stats(self, run: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(_Call("GET", f"/v1/runs/{run}/stats"))
        return result

    async def participants(self, run: str) -> list[dict[str, Any]]:
        """The run's registered participants: id, kind, epoch, registered and last seen."""
        body = await self._send(_Call("GET", f"/v1/runs/{run}/participants"))
        return list(body["participants"])

    async def quarantine(
        self, run: str, *, after: str | None = None, limit: int | None = None
    ) -> dict[str, Any]:
        """One page of the run's quarantined log records after ``PARTITION:OFFSET`` ``after``:
        ``{"records", "next_after"}`` (``GET …/quarantine``; docs/api.md, Bad records)."""
        result: dict[str, Any] = await self._send(self._quarantine_call(run, after, limit))
        return result

    async def projector(self, run: str) -> dict[str, Any]:
        """How far this service's projector trails the run's log, per partition."""
        result: dict[str, Any] = await self._send(_Call("GET", f"/v1/runs/{run}/projector"))
        return result

    async def episodes(self, run: str, *, status: str | None = None) -> AsyncIterator[Any]:
        """Every episode of the run (streamed)."""
        async for item in self._lines(
            _Call("GET", f"/v1/runs/{run}/episodes", _params(status=status))
        ):
            yield item

    # -- checkpoints -----------------------------------------------------------------------

    async def checkpoint(
        self,
        run: str,
        *,
        controller_epoch: int | None = None,
        deadline_s: float | None = None,
        wait: bool = True,
        trigger: str = "request",
        request_id: str | None = None,
    ) -> CheckpointInfo:
        """Take a checkpoint; ``status`` is ``pending`` when ``wait=False`` left it open. With
        several URLs, moves to the next on a transport error or a retriable refusal until the
        deadline (docs/api.md, "Several service URLs"). ``request_id``: the request's id (a
        random one by default): a call with one whose checkpoint was begun is answered with
        that checkpoint (to retry a call that failed unanswered, pass its id again)."""
        epoch = self._epoch(run, controller_epoch)
        attempt = CheckpointAttempt.begin(request_id)
        if self._urls is None:
            call = self._checkpoint_call(run, epoch, deadline_s, wait, trigger, attempt.request_id)
            return self._staging.info(run, await self._send(call))
        rounds = Rounds(checkpoint_budget_s(deadline_s))
        while True:
            try:
                if attempt.unanswered:  # was it taken? the catalog knows
                    requested = self._requested_call(run, attempt.request_id)
                    found = attempt.taken((await self._send_once(requested))["checkpoints"], wait)
                    if found is not None:
                        return self._staging.info(run, found)
                call = self._checkpoint_call(
                    run, epoch, deadline_s, wait, trigger, attempt.request_id
                )
                call = replace(call, timeout_s=min(self.timeout_s, checkpoint_answer_s(deadline_s)))
                return self._staging.info(run, await self._send_once(call))
            except CheckpointInProgress as e:
                # Another request's (maybe this call's, unanswered; maybe a dead replica's,
                # superseded once its requester's lease lapsed): ask again soon.
                pause = self._moved(rounds, e) if rounds.expired() else POLL_S
            except httpx.TransportError as e:
                attempt.unanswered |= not movable_transport(e, "POST")
                pause = self._moved(rounds, e)
            except RolloutlogError as e:
                if not movable_error(e, "POST"):
                    raise
                pause = self._moved(rounds, e)
            await asyncio.sleep(pause)

    async def get_checkpoint(self, run: str, checkpoint_id: CheckpointRef) -> CheckpointInfo:
        path = self._checkpoint_path(run, checkpoint_id)
        return CheckpointInfo.from_json(await self._send(_Call("GET", path)))

    async def wait_for_checkpoint(
        self, run: str, checkpoint_id: int, *, poll_s: float = 0.25, timeout_s: float | None = None
    ) -> CheckpointInfo:
        """Poll a pending checkpoint until it commits or aborts."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            info = await self.get_checkpoint(run, checkpoint_id)
            if info.status != "pending" or (deadline is not None and time.monotonic() > deadline):
                return info
            await asyncio.sleep(poll_s)

    async def list_checkpoints(
        self, run: str, *, status: str | None = None, limit: int = 100
    ) -> list[CheckpointInfo]:
        call = _Call("GET", f"/v1/runs/{run}/checkpoints", _params(status=status, limit=limit))
        return [CheckpointInfo.from_json(c) for c in (await self._send(call))["checkpoints"]]

    async def manifest(self, run: str, checkpoint_id: int) -> AsyncIterator[Any]:
        """The checkpoint's manifest entries (streamed NDJSON)."""
        async for item in self._lines(
            _Call("GET", self._checkpoint_path(run, checkpoint_id) + "/manifest")
        ):
            yield item

    # -- results ---------------------------------------------------------------------------

    async def results(
        self,
        run: str,
        *,
        since_checkpoint: int | None = None,
        episodes: Iterable[str] | None = None,
        unacknowledged: bool = False,
    ) -> list[EpisodeResult]:
        """Finished episodes' results, by episode id: those finished past a checkpoint's cut,
        of some episodes, or not acknowledged yet (the ones a crash kept from the trainer)."""
        return [
            EpisodeResult.from_json(item)
            for call in self._results_calls(run, since_checkpoint, episodes, unacknowledged)
            async for item in self._lines(call)
        ]

    async def ack_results(self, run: str, episodes: Iterable[str]) -> int:
        """Acknowledge the results the trainer holds (idempotent); how many were new."""
        call = self._ack_call(run, episodes)
        return 0 if call is None else int((await self._send(call))["acknowledged"])

    # -- restores --------------------------------------------------------------------------

    async def restore(
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
        return RestoreInfo.from_json(await self._send(call))

    async def get_restore(self, run: str, restore_id: int) -> RestoreInfo:
        """A restore with its episodes."""
        return RestoreInfo.from_json(
            await self._send(_Call("GET", f"/v1/runs/{run}/restores/{restore_id}"))
        )

    async def list_restores(self, run: str, *, limit: int = 100) -> list[RestoreInfo]:
        """The run's restores, newest first (without their episodes)."""
        body = await self._send(self._restores_call(run, limit))
        return [RestoreInfo.from_json(r) for r in body["restores"]]

    async def episode_history(
        self, run: str, episode: str, *, after: int | None = None, limit: int | None = None
    ) -> dict[str, Any]:
        """One episode across attempts: why each began, its manifest and plan entries, its
        event timeline from offset ``after`` on (``GET …/episodes/{episode}``; docs/api.md)."""
        result: dict[str, Any] = await self._send(self._history_call(run, episode, after, limit))
        return result

    async def restore_episodes(
        self, run: str, restore_id: int, *, action: str | None = None
    ) -> AsyncIterator[RestoreEpisode]:
        call = _Call(
            "GET", f"/v1/runs/{run}/restores/{restore_id}/episodes", _params(action=action)
        )
        async for item in self._lines(call):
            yield RestoreEpisode.from_json(item)

    async def projection(
        self,
        run: str,
        episode: str,
        *,
        restore: CheckpointRef | None = None,
        checkpoint: int | None = None,
    ) -> dict[str, Any]:
        """One episode's projection (of a restore, or at a checkpoint's cut).

        The projection routes are the participants' (docs/design.md §8): the client's token must hold
        the participant role (or admin); a trainer token gets ``Forbidden``.
        """
        result: dict[str, Any] = await self._send(
            self._projection_call(run, episode, restore, checkpoint)
        )
        return result

    async def projections(
        self, run: str, restore_id: int, *, kind: str | None = None, participant: str | None = None
    ) -> AsyncIterator[Any]:
        """A restore's projections for one participant kind / id (streamed; the token must hold
        the participant role or admin, as for ``projection``)."""
        call = _Call(
            "GET",
            f"/v1/runs/{run}/restores/{restore_id}/projections",
            _params(kind=kind, participant=participant),
        )
        async for item in self._lines(call):
            yield item


class TrainerClient(_Calls):
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
        self._client = client or httpx.Client(base_url=base, timeout=timeout_s)

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

    def _send_once(self, call: _Call) -> Any:
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

    def _send(self, call: _Call) -> Any:
        rounds = Rounds(self.failover_s)
        while True:
            try:
                return self._send_once(call)
            except (httpx.TransportError, RolloutlogError) as e:
                if not self._movable(e, call.method):
                    raise
                pause = self._moved(rounds, e)
            time.sleep(pause)

    def _lines(self, call: _Call) -> Iterator[Any]:
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
                            yield _line(line)
                    for line in lines.end():
                        yield _line(line)
                return
            except (httpx.TransportError, RolloutlogError) as e:
                if streaming or not self._movable(e, call.method):
                    raise
                pause = self._moved(rounds, e)
            time.sleep(pause)

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._send(_Call("GET", "/readyz"))
        return result

    def create_run(self, run: str, partitions: int | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self._send(
            _Call("POST", "/v1/runs", json=_params(run=run, partitions=partitions))
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
        """``AsyncTrainerClient.fork_run``."""
        call = _fork_call(run, source, checkpoint_id, episodes, exclude)
        result: dict[str, Any] = self._send(call)
        return result

    def get_run(self, run: str) -> dict[str, Any]:
        result: dict[str, Any] = self._send(_Call("GET", f"/v1/runs/{run}"))
        return result

    def delete_run(self, run: str) -> dict[str, Any]:
        """Delete the run: its log, catalog rows and the service's resources for it."""
        result: dict[str, Any] = self._send(_Call("DELETE", f"/v1/runs/{run}"))
        self.controller_epochs.pop(run, None)
        return result

    def list_runs(self) -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = []
        after: str | None = None
        while True:
            page = self._send(_Call("GET", "/v1/runs", _params(after=after, limit=500)))
            runs.extend(page["runs"])
            after = page.get("next_after")
            if after is None:
                return runs

    def register_participant(self, run: str, participant_id: str, kind: str) -> int:
        body = {"id": participant_id, "kind": kind}
        return int(self._send(_Call("POST", f"/v1/runs/{run}/participants", json=body))["epoch"])

    def take_over(self, run: str, *, expected_epoch: int | None = None) -> int:
        body = _params(expected_epoch=expected_epoch)
        result = self._send(_Call("POST", f"/v1/runs/{run}/controller", json=body))
        epoch = int(result["controller_epoch"])
        self.controller_epochs[run] = epoch
        return epoch

    def stats(self, run: str) -> dict[str, Any]:
        result: dict[str, Any] = self._send(_Call("GET", f"/v1/runs/{run}/stats"))
        return result

    def participants(self, run: str) -> list[dict[str, Any]]:
        """The run's registered participants: id, kind, epoch, registered and last seen."""
        body = self._send(_Call("GET", f"/v1/runs/{run}/participants"))
        return list(body["participants"])

    def quarantine(
        self, run: str, *, after: str | None = None, limit: int | None = None
    ) -> dict[str, Any]:
        """One page of the run's quarantined records (see ``AsyncTrainerClient.quarantine``)."""
        result: dict[str, Any] = self._send(self._quarantine_call(run, after, limit))
        return result

    def projector(self, run: str) -> dict[str, Any]:
        """How far this service's projector trails the run's log, per partition."""
        result: dict[str, Any] = self._send(_Call("GET", f"/v1/runs/{run}/projector"))
        return result

    def episodes(self, run: str, *, status: str | None = None) -> Iterator[Any]:
        return self._lines(_Call("GET", f"/v1/runs/{run}/episodes", _params(status=status)))

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
            self._send(_Call("GET", self._checkpoint_path(run, checkpoint_id)))
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
        call = _Call("GET", f"/v1/runs/{run}/checkpoints", _params(status=status, limit=limit))
        return [CheckpointInfo.from_json(c) for c in self._send(call)["checkpoints"]]

    def manifest(self, run: str, checkpoint_id: int) -> Iterator[Any]:
        return self._lines(_Call("GET", self._checkpoint_path(run, checkpoint_id) + "/manifest"))

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
            self._send(_Call("GET", f"/v1/runs/{run}/restores/{restore_id}"))
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
        call = _Call(
            "GET", f"/v1/runs/{run}/restores/{restore_id}/episodes", _params(action=action)
        )
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
        call = _Call(
            "GET",
            f"/v1/runs/{run}/restores/{restore_id}/projections",
            _params(kind=kind, participant=participant),
        )
        return self._lines(call)
