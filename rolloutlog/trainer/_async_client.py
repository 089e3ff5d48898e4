"""``AsyncTrainerClient``: the trainer's REST client of the service, async (the calls are
``_calls``'s, the blocking twin is ``_client.TrainerClient``; see ``_client`` for both)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, Self

import httpx
import orjson

from rolloutlog._plain_http import async_service_client
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
from rolloutlog.wire import NDJSON, NdjsonSplitter

__all__ = ["AsyncTrainerClient"]


class AsyncTrainerClient(Calls):
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
        self._client = client or async_service_client(self.url, timeout_s, base_url=base)

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

    async def _send_once(self, call: Call) -> Any:
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

    async def _send(self, call: Call) -> Any:
        rounds = Rounds(self.failover_s)
        while True:
            try:
                return await self._send_once(call)
            except (httpx.TransportError, RolloutlogError) as e:
                if not self._movable(e, call.method):
                    raise
                pause = self._moved(rounds, e)
            await asyncio.sleep(pause)

    async def _lines(self, call: Call) -> AsyncIterator[Any]:
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
                            yield ndjson_line(line)
                    for line in lines.end():
                        yield ndjson_line(line)
                return
            except (httpx.TransportError, RolloutlogError) as e:
                if streaming or not self._movable(e, call.method):
                    raise
                pause = self._moved(rounds, e)
            await asyncio.sleep(pause)

    # -- runs ------------------------------------------------------------------------------

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(Call("GET", "/readyz"))
        return result

    async def create_run(self, run: str, partitions: int | None = None) -> dict[str, Any]:
        body = query(run=run, partitions=partitions)
        result: dict[str, Any] = await self._send(Call("POST", "/v1/runs", json=body))
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
        ``episodes``, minus ``exclude``); the reply's ``forked_from`` names the checkpoint and
        its ``staging_keys`` every staging key the fork's checkpoint 1 references (as
        ``CheckpointInfo.staging_keys`` does a checkpoint's; null once that checkpoint is no
        longer kept). The same fork again answers as created; ``resume_run(run)`` then
        continues them."""
        call = fork_call(run, source, checkpoint_id, episodes, exclude)
        result: dict[str, Any] = await self._send(call)
        return result

    async def get_run(self, run: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(Call("GET", f"/v1/runs/{run}"))
        return result

    async def delete_run(self, run: str) -> dict[str, Any]:
        """Delete the run: its log, catalog rows and the service's resources for it."""
        result: dict[str, Any] = await self._send(Call("DELETE", f"/v1/runs/{run}"))
        self.controller_epochs.pop(run, None)
        return result

    async def list_runs(self) -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = []
        after: str | None = None
        while True:
            page = await self._send(Call("GET", "/v1/runs", query(after=after, limit=500)))
            runs.extend(page["runs"])
            after = page.get("next_after")
            if after is None:
                return runs

    async def register_participant(self, run: str, participant_id: str, kind: str) -> int:
        body = {"id": participant_id, "kind": kind}
        result = await self._send(Call("POST", f"/v1/runs/{run}/participants", json=body))
        return int(result["epoch"])

    async def take_over(self, run: str, *, expected_epoch: int | None = None) -> int:
        """Become the run's controller; later calls of this client use the new epoch."""
        body = query(expected_epoch=expected_epoch)
        result = await self._send(Call("POST", f"/v1/runs/{run}/controller", json=body))
        epoch = int(result["controller_epoch"])
        self.controller_epochs[run] = epoch
        return epoch

    async def stats(self, run: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(Call("GET", f"/v1/runs/{run}/stats"))
        return result

    async def participants(self, run: str) -> list[dict[str, Any]]:
        """The run's registered participants: id, kind, epoch, registered and last seen."""
        body = await self._send(Call("GET", f"/v1/runs/{run}/participants"))
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
        result: dict[str, Any] = await self._send(Call("GET", f"/v1/runs/{run}/projector"))
        return result

    async def episodes(self, run: str, *, status: str | None = None) -> AsyncIterator[Any]:
        """Every episode of the run (streamed)."""
        async for item in self._lines(
            Call("GET", f"/v1/runs/{run}/episodes", query(status=status))
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
        return CheckpointInfo.from_json(await self._send(Call("GET", path)))

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
        call = Call("GET", f"/v1/runs/{run}/checkpoints", query(status=status, limit=limit))
        return [CheckpointInfo.from_json(c) for c in (await self._send(call))["checkpoints"]]

    async def manifest(self, run: str, checkpoint_id: int) -> AsyncIterator[Any]:
        """The checkpoint's manifest entries (streamed NDJSON)."""
        async for item in self._lines(
            Call("GET", self._checkpoint_path(run, checkpoint_id) + "/manifest")
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
            await self._send(Call("GET", f"/v1/runs/{run}/restores/{restore_id}"))
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
        call = Call("GET", f"/v1/runs/{run}/restores/{restore_id}/episodes", query(action=action))
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
        call = Call(
            "GET",
            f"/v1/runs/{run}/restores/{restore_id}/projections",
            query(kind=kind, participant=participant),
        )
        async for item in self._lines(call):
            yield item
