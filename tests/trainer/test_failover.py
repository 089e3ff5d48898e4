"""The trainer clients over several service URLs (docs/api.md, "Several service URLs"): which
failures move a call to the next URL, and a checkpoint request sent again after an unanswered
one never begins a second checkpoint. Against scripted replies (``httpx.MockTransport``); the
real replicas are in ``tests/e2e/test_replica_liveness.py``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from rolloutlog.errors import BackendUnavailable, StaleController
from rolloutlog.trainer import AsyncTrainerClient, TrainerClient
from rolloutlog.wire import service_urls

URLS = ["http://a:1", "http://b:2", "http://c:3"]
RUN = "run"


def error(status: int, code: str, **details: Any) -> httpx.Response:
    body = {"error": {"code": code, "message": code, "details": details}}
    return httpx.Response(status, content=orjson.dumps(body))


def checkpoint_body(checkpoint_id: int, status: str, epoch: int = 1) -> dict[str, Any]:
    return {
        "checkpoint_id": checkpoint_id,
        "status": status,
        "counts": {"continue": 1, "restart": 0, "finished": 0},
        "offsets": [],
        "controller_epoch": epoch,
        "requested_at": time.time(),
        "trigger": "request",
    }


class Script:
    """Replies by host, in order; records each request as ``(host, method, path)``."""

    def __init__(self, **replies: list[Callable[[httpx.Request], httpx.Response]]) -> None:
        self.replies = replies
        self.seen: list[tuple[str, str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.url.host, request.method, request.url.path))
        queue = self.replies[request.url.host]
        reply = queue.pop(0) if len(queue) > 1 else queue[0]
        return reply(request)


def refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def reset(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadError("connection reset by peer", request=request)


def replies(response: httpx.Response | dict[str, Any]) -> Callable[[httpx.Request], httpx.Response]:
    def reply(request: httpx.Request) -> httpx.Response:
        if isinstance(response, httpx.Response):
            return response
        return httpx.Response(201, content=orjson.dumps(response))

    return reply


def clients(script: Script, urls: Any = URLS) -> tuple[AsyncTrainerClient, TrainerClient]:
    transport = httpx.MockTransport(script)
    async_client = AsyncTrainerClient(urls, client=httpx.AsyncClient(transport=transport))
    sync_client = TrainerClient(urls, client=httpx.Client(transport=transport))
    for client in (async_client, sync_client):
        client.controller_epochs[RUN] = 1
    return async_client, sync_client


def test_service_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    assert service_urls("http://a:1/, http://b:2") == ("http://a:1", "http://b:2")
    assert service_urls(["http://a:1/"]) == ("http://a:1",)
    monkeypatch.setenv("ROLLOUTLOG_URL", "http://x:1,http://y:2")
    assert service_urls(None) == ("http://x:1", "http://y:2")
    assert AsyncTrainerClient().urls == ("http://x:1", "http://y:2")
    assert TrainerClient("http://z:3").urls == ("http://z:3",)


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_refused_connection_and_unavailable_move_to_the_next_url(kind: str) -> None:
    script = Script(
        a=[refused],
        b=[replies(error(503, "unavailable"))],
        c=[replies(checkpoint_body(4, "committed"))],
    )
    async_client, sync_client = clients(script)
    if kind == "async":
        info = await async_client.checkpoint(RUN, deadline_s=2)
    else:
        info = sync_client.checkpoint(RUN, deadline_s=2)
    assert info.checkpoint_id == 4 and info.status == "committed"
    assert [host for host, _, _ in script.seen] == ["a", "b", "c"]
    # The next call starts where the last one succeeded.
    script.seen.clear()
    if kind == "async":
        await async_client.get_checkpoint(RUN, 4)
    else:
        sync_client.get_checkpoint(RUN, 4)
    assert [host for host, _, _ in script.seen] == ["c"]


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_write_that_may_have_been_taken_is_not_sent_again(kind: str) -> None:
    """A restore whose connection reset after it was sent: the caller's error, as with one URL
    (sending it again could restore twice); a read is asked of the next URL."""
    script = Script(a=[reset], b=[replies({"restore_id": 1})])
    async_client, sync_client = clients(script)
    with pytest.raises(httpx.ReadError):
        if kind == "async":
            await async_client.restore(RUN)
        else:
            sync_client.restore(RUN)
    assert [host for host, _, _ in script.seen] == ["a"]
    script.seen.clear()
    script.replies["b"] = [lambda request: httpx.Response(200, content=b'{"runs": []}')]
    if kind == "async":
        assert await async_client.list_runs() == []
    else:
        assert sync_client.list_runs() == []
    assert [host for host, _, _ in script.seen] == ["a", "b"]


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_an_unanswered_checkpoint_is_found_not_begun_twice(kind: str) -> None:
    """The request reached a replica that died before answering; its checkpoint (7) is pending
    on the next replica's catalog view, then commits: it is the answer, no second one begun."""
    pending, committed = checkpoint_body(7, "pending"), checkpoint_body(7, "committed")
    newest = [
        replies(httpx.Response(200, content=orjson.dumps({"checkpoints": [pending]}))),
        replies(httpx.Response(200, content=orjson.dumps({"checkpoints": [committed]}))),
    ]

    def b(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return newest.pop(0)(request) if len(newest) > 1 else newest[0](request)
        return error(409, "checkpoint_in_progress", checkpoint_id=7)

    timeouts: list[float] = []

    def a(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"]["read"])
        raise httpx.ReadTimeout("a paused replica", request=request)

    script = Script(a=[a], b=[b])
    async_client, sync_client = clients(script)
    if kind == "async":
        info = await async_client.checkpoint(RUN, deadline_s=2)
    else:
        info = sync_client.checkpoint(RUN, deadline_s=2)
    assert info.checkpoint_id == 7 and info.status == "committed"
    posts = [(host, path) for host, method, path in script.seen if method == "POST"]
    assert posts == [("a", "/v1/runs/run/checkpoints"), ("b", "/v1/runs/run/checkpoints")]
    assert timeouts == [2 + 6]  # the deadline, and the service's grace to answer


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_stale_controller_is_not_retried_and_time_is_bounded(kind: str) -> None:
    script = Script(a=[replies(error(409, "stale_controller"))], b=[refused], c=[refused])
    async_client, sync_client = clients(script)
    with pytest.raises(StaleController):
        if kind == "async":
            await async_client.checkpoint(RUN, deadline_s=1)
        else:
            sync_client.checkpoint(RUN, deadline_s=1)
    assert len(script.seen) == 1
    # Every replica unavailable: the call gives up by its deadline plus the grace.
    script = Script(a=[replies(error(503, "unavailable"))], b=[refused], c=[refused])
    async_client, sync_client = clients(script)
    async_client.failover_s = sync_client.failover_s = 0.5
    started = time.monotonic()
    with pytest.raises(BackendUnavailable):
        if kind == "async":
            await async_client.get_run(RUN)
        else:
            sync_client.get_run(RUN)
    assert 0.5 <= time.monotonic() - started < 3


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_one_url_fails_as_before(kind: str) -> None:
    script = Script(a=[refused])
    async_client, sync_client = clients(script, URLS[0])
    with pytest.raises(httpx.ConnectError):
        if kind == "async":
            await async_client.checkpoint(RUN)
        else:
            sync_client.checkpoint(RUN)
    assert len(script.seen) == 1
