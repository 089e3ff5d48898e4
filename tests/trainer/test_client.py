"""The trainer clients against the app in process (``httpx.ASGITransport``): runs, takeover,
checkpoints, restores, manifests, projections, the checkpoint schedule, signals, resume_run."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rolloutlog.errors import (
    BackendUnavailable,
    CheckpointInProgress,
    Forbidden,
    InvalidRequest,
    StaleController,
    Unauthorized,
    UnknownCheckpoint,
    UnknownRun,
)
from rolloutlog.log import Record, partition_for
from rolloutlog.trainer import (
    AsyncTrainerClient,
    CheckpointInfo,
    CheckpointScheduler,
    ServiceError,
    error_from_body,
    resume_run,
)
from tests import factories as f
from tests.api.conftest import TOKENS, Api, open_api, settings_for
from tests.faults._supervise import bad_records, eventually


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async with open_api(settings_for(tmp_path / "data")) as opened:
        yield opened


@pytest.fixture
async def trainer(api: Api) -> AsyncIterator[AsyncTrainerClient]:
    async with AsyncTrainerClient(token=TOKENS["trainer"], client=api.client) as client:
        yield client


@pytest.fixture
async def admin(api: Api) -> AsyncIterator[AsyncTrainerClient]:
    async with AsyncTrainerClient(token=TOKENS["admin"], client=api.client) as client:
        yield client


async def test_runs_takeover_checkpoints_and_restores(
    api: Api, trainer: AsyncTrainerClient, admin: AsyncTrainerClient
) -> None:
    assert await trainer.create_run("run", partitions=4) == {"run": "run", "partitions": 4}
    await api.register()
    await api.append(f.started("a"), f.boundary("a", "seed", {"turn": 1}))
    await api.append(f.started("b"), f.boundary("b"), f.finished("b"))
    with pytest.raises(InvalidRequest, match="take_over"):
        await trainer.checkpoint("run")
    epoch = await trainer.take_over("run")
    assert trainer.controller_epochs == {"run": epoch}
    info = await trainer.checkpoint("run", deadline_s=5)
    assert isinstance(info, CheckpointInfo)
    assert (info.status, dict(info.counts)) == (
        "committed",
        {"continue": 1, "restart": 0, "finished": 1},
    )
    assert (await admin.get_checkpoint("run", "latest")).checkpoint_id == info.checkpoint_id
    assert [c.checkpoint_id for c in await admin.list_checkpoints("run")] == [info.checkpoint_id]
    manifest = [entry async for entry in trainer.manifest("run", info.checkpoint_id)]
    assert [(m["episode"], m["action"]) for m in manifest] == [("a", "continue"), ("b", "finished")]
    restore = await trainer.restore("run")
    assert dict(restore.counts) == {"continue": 1, "restart": 0, "excluded": 0}
    detail = await trainer.get_restore("run", restore.restore_id)
    assert detail.episodes is not None
    assert [(e.episode, e.capture_key) for e in detail.episodes] == [("a", "a-a1")]
    projection = await admin.projection("run", "a", restore=restore.restore_id)
    assert projection["boundaries"]["environment"]["state"] == {"turn": 1}
    bulk = [p async for p in admin.projections("run", restore.restore_id, kind="environment")]
    assert [p["capture_key"] for p in bulk] == ["a-a1"]
    episodes = [e async for e in admin.episodes("run")]
    # b finished before the cut: the checkpoint recorded it (and its result) before committing.
    assert [(e["capture_key"], e["status"]) for e in episodes] == [
        ("a-a1", "running"),
        ("b", "finished"),
    ]
    assert (await admin.stats("run"))["restores"]["count"] == 1
    assert [r["run"] for r in await admin.list_runs()] == ["run"]
    assert (await admin.health())["status"] == "ready"


async def test_errors_are_raised_as_rolloutlog_errors(
    api: Api, trainer: AsyncTrainerClient
) -> None:
    with pytest.raises(UnknownRun):
        await trainer.take_over("nope")
    await trainer.create_run("run")
    old = await trainer.take_over("run")
    await trainer.take_over("run")
    with pytest.raises(StaleController) as stale:
        await trainer.checkpoint("run", controller_epoch=old)
    assert stale.value.details["current_epoch"] == old + 1
    with pytest.raises(UnknownCheckpoint):
        await trainer.restore("run")
    with pytest.raises(Forbidden):
        await trainer.projection("run", "a", restore=1)  # a participant's route
    async with AsyncTrainerClient(token="wrong-token-000000000", client=api.client) as anonymous:
        with pytest.raises(Unauthorized):
            await anonymous.list_runs()


async def test_a_pending_checkpoint_can_be_awaited(api: Api, trainer: AsyncTrainerClient) -> None:
    await api.seed(["a"])
    await api.append(f.step_started("a", "verify", "wait"))
    await trainer.take_over("run")
    pending = await trainer.checkpoint("run", wait=False, deadline_s=30)
    assert pending.status == "pending"
    with pytest.raises(CheckpointInProgress):
        await trainer.checkpoint("run")
    waiter = asyncio.create_task(
        trainer.wait_for_checkpoint("run", pending.checkpoint_id, poll_s=0.02)
    )
    await asyncio.sleep(0.1)
    await api.append(f.boundary("a", "verify"))
    assert (await asyncio.wait_for(waiter, 10)).status == "committed"


async def test_the_timer_checkpoints_every_period(api: Api, trainer: AsyncTrainerClient) -> None:
    await api.seed(["a"])
    await trainer.take_over("run")
    seen: list[int] = []
    async with CheckpointScheduler(
        trainer, "run", checkpoint_every_s=0.1, on_checkpoint=lambda i: seen.append(i.checkpoint_id)
    ) as scheduler:
        for _ in range(100):
            if len(seen) >= 3:
                break
            await asyncio.sleep(0.05)
    assert seen[:3] == [1, 2, 3]
    assert scheduler.taken[0].raw["trigger"] == "timer"
    assert not scheduler.errors


async def test_a_fenced_controller_stops_the_schedule(
    api: Api, trainer: AsyncTrainerClient
) -> None:
    await api.seed(["a"])
    await trainer.take_over("run")
    async with CheckpointScheduler(trainer, "run", checkpoint_every_s=0.05) as scheduler:
        await api.take_over()  # another trainer takes over
        await asyncio.wait_for(scheduler.stop_requested.wait(), 10)
    assert scheduler.fenced
    assert isinstance(scheduler.errors[0], StaleController)


async def test_sigusr1_checkpoints_and_sigterm_checkpoints_then_stops(
    api: Api, trainer: AsyncTrainerClient
) -> None:
    await api.seed(["a"])
    await trainer.take_over("run")
    previous = signal.getsignal(signal.SIGTERM)
    async with CheckpointScheduler(trainer, "run") as scheduler:
        scheduler.install_signal_handlers()
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(200):
            if scheduler.taken:
                break
            await asyncio.sleep(0.02)
        assert [i.raw["trigger"] for i in scheduler.taken] == ["sigusr1"]
        assert not scheduler.stop_requested.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(scheduler.wait_for_stop(), 10)
        assert [i.raw["trigger"] for i in scheduler.taken] == ["sigusr1", "sigterm"]
    assert signal.getsignal(signal.SIGTERM) == previous  # handlers removed on stop


async def test_resume_run_dispatches_continued_and_restarted_rollouts(
    api: Api, trainer: AsyncTrainerClient
) -> None:
    await api.seed(["a", "b", "c", "d"])
    await api.register("res-0", "resources")  # an unregistered participant is refused
    await api.append(f.session_started("c", "s1", "restart_only"), f.boundary("c", "x"))
    await api.append(f.finished("d"))
    await trainer.take_over("run")
    await trainer.checkpoint("run")
    plan = await resume_run(trainer, "run", exclude=["b"])
    assert plan.checkpoint_id == 1
    assert plan.controller_epoch == trainer.controller_epochs["run"]
    assert [(d.episode, d.capture_key, d.action) for d in plan.dispatch] == [
        ("a", "a-a1", "continue"),
        ("c", "c-a1", "restart"),
    ]
    assert [d.episode for d in plan.continued] == ["a"]
    assert plan.restarted[0].reason
    assert plan.excluded == ("b",)
    assert plan.finished == ("d",)


async def test_resume_run_asks_again_after_a_retriable_refusal(
    api: Api, trainer: AsyncTrainerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore the catalog aborted (say on a PostgreSQL deadlock: ``unavailable``, nothing
    written) is asked again; a refusal that is not retriable is raised at once."""
    await api.seed(["a"])
    await trainer.take_over("run")
    await trainer.checkpoint("run")
    real = trainer.restore
    refusals = [BackendUnavailable("PostgreSQL catalog unavailable (40P01): deadlock detected")]

    async def flaky(*args: Any, **kwargs: Any) -> Any:
        if refusals:
            raise refusals.pop()
        return await real(*args, **kwargs)

    monkeypatch.setattr(trainer, "restore", flaky)
    plan = await resume_run(trainer, "run")
    assert not refusals and plan.restore_id == 1
    assert [d.episode for d in plan.continued] == ["a"]
    refusals.append(StaleController("not retriable"))
    with pytest.raises(StaleController):
        await resume_run(trainer, "run")


async def test_resume_without_a_checkpoint_starts_fresh(trainer: AsyncTrainerClient) -> None:
    await trainer.create_run("run")
    plan = await resume_run(trainer, "run")
    assert (plan.checkpoint_id, plan.restore_id, plan.dispatch) == (None, None, ())
    assert plan.controller_epoch == 1


async def test_client_url_and_token_from_the_environment(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUTLOG_URL", "http://rolloutlog.test")
    monkeypatch.setenv("ROLLOUTLOG_TOKEN", TOKENS["analyst"])
    transport = httpx.ASGITransport(app=api.client._transport.app)  # type: ignore[attr-defined]
    async with (
        httpx.AsyncClient(transport=transport) as raw,
        AsyncTrainerClient(client=raw, url="http://rolloutlog.test") as client,
    ):
        assert await client.list_runs() == []


def test_unknown_error_codes_become_service_errors() -> None:
    error = error_from_body(404, {"error": {"code": "not_found", "message": "no", "details": {}}})
    assert isinstance(error, ServiceError)
    assert (error.code, error.http_status) == ("not_found", 404)
    assert isinstance(error_from_body(502, "<html>"), ServiceError)
    known = error_from_body(
        409, {"error": {"code": "stale_controller", "message": "m", "details": {"x": 1}}}
    )
    assert isinstance(known, StaleController)
    assert known.details == {"x": 1}


async def test_participants_projector_and_quarantine_pages(api: Api) -> None:
    analyst = AsyncTrainerClient(token=TOKENS["analyst"], client=api.client)
    await api.seed(["a"])
    [participant] = await analyst.participants("run")
    assert (participant["id"], participant["kind"], participant["epoch"]) == (
        "env-0",
        "environment",
        1,
    )
    # Three records no HTTP append would take, straight into a's partition of the log.
    home = partition_for("a", 4)
    await api.service.log.append_records(
        "run", [Record(home, b"a", value) for value in bad_records("a")]
    )

    async def quarantined() -> bool:
        return len((await analyst.quarantine("run"))["records"]) == 3

    await eventually(quarantined, 10, "the quarantine listing")
    first = await analyst.quarantine("run", limit=2)
    assert [r["partition"] for r in first["records"]] == [home, home]
    assert first["next_after"] == f"{home}:{first['records'][-1]['offset']}"
    rest = await analyst.quarantine("run", after=first["next_after"], limit=2)
    assert len(rest["records"]) == 1 and rest["next_after"] is None
    assert "not a JSON envelope" in first["records"][0]["reason"]

    async def caught_up() -> bool:
        return int((await analyst.projector("run"))["lag"]) == 0

    await eventually(caught_up, 10, "the projector past the bad records")
    lag = await analyst.projector("run")
    assert lag["log_records"] == sum(p["end_offset"] for p in lag["partitions"])
    assert len(lag["partitions"]) == 4 and lag["partitions"][home]["end_offset"] >= 5
    with pytest.raises(UnknownRun):
        await analyst.projector("nope")
    with pytest.raises(UnknownRun):
        await analyst.participants("nope")
    with pytest.raises(InvalidRequest):
        await analyst.quarantine("run", after="nowhere")


async def test_a_checkpoint_reply_lists_what_changed_and_the_client_composes_every_key(
    api: Api, trainer: AsyncTrainerClient
) -> None:
    await trainer.create_run("run", partitions=2)
    await api.register()
    await api.register("policy-0", "policy")
    await api.append(f.started("a"), f.ledger_row("a"), f.boundary("a"))
    await api.append(f.started("b"), f.ledger_row("b"), f.boundary("b"))
    await trainer.take_over("run")
    first = await trainer.checkpoint("run")
    assert "staging_keys" in first.raw and "staging_keys_added" not in first.raw
    assert sorted(first.staging_keys or ()) == ["stage-a-c1", "stage-b-c1"]
    await api.append(f.finished("b"))
    await api.append(f.started("c"), f.ledger_row("c"), f.boundary("c"))
    second = await trainer.checkpoint("run")
    # The request named the first checkpoint: the reply says only what changed.
    assert "staging_keys" not in second.raw
    assert second.raw["staging_keys_since"] == first.checkpoint_id
    assert (second.raw["staging_keys_added"], second.raw["staging_keys_removed"]) == (
        ["stage-c-c1"],
        ["stage-b-c1"],
    )
    assert sorted(second.staging_keys or ()) == ["stage-a-c1", "stage-c-c1"]
    # Another client holds no keys: its reply lists them all.
    async with AsyncTrainerClient(token=TOKENS["trainer"], client=api.client) as other:
        await other.take_over("run")
        third = await other.checkpoint("run")
    assert sorted(third.raw["staging_keys"]) == ["stage-a-c1", "stage-c-c1"]
    # This client still names the second: not the base any more, so every key comes listed.
    fourth = await trainer.checkpoint("run", controller_epoch=other.controller_epochs["run"])
    assert "staging_keys_added" not in fourth.raw
    assert sorted(fourth.staging_keys or ()) == ["stage-a-c1", "stage-c-c1"]


async def test_a_forks_reply_lists_the_staging_keys_of_its_checkpoint_1(
    api: Api, trainer: AsyncTrainerClient
) -> None:
    """As a checkpoint's reply lists its keys: the fork's first checkpoint references the
    source's keys of the episodes forked (unrenamed), and the fork's next checkpoint lists the
    same while nothing changed."""
    from tests.api.test_forks import SOURCE, build_source

    await build_source(api)
    forked = await trainer.fork_run("fork-1", SOURCE, exclude=["again"])
    assert sorted(forked["staging_keys"]) == ["stage-live-c1", "stage-live-c3"]
    none = await trainer.fork_run("fork-2", SOURCE, episodes=["again", "other"])
    assert none["staging_keys"] == []
    await trainer.take_over("fork-1")
    first = await trainer.checkpoint("fork-1")
    assert sorted(first.staging_keys or ()) == sorted(forked["staging_keys"])
