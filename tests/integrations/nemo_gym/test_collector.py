"""The collector: NeMo Gym's dataset rows in, NeMo Gym's rollout rows out, the environment's
events in between, and a resume after a crash that loses no row and writes none twice (in
process: the service over ASGI, a stand-in agent)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rolloutlog.errors import RunExists
from rolloutlog.integrations.nemo_gym import GymCollector, episode_id, materialize_rows
from rolloutlog.integrations.nemo_gym._collector import _Output
from tests.integrations.nemo_gym._apps import FakeAgent
from tests.participants.conftest import RUN, World

AGENT = "my_agent"


def dataset(count: int) -> list[bytes]:
    return [
        orjson.dumps({"responses_create_params": {"input": f"q{i}"}, "expected": float(i)})
        for i in range(count)
    ]


def test_rows_are_materialized_as_ng_collect_rollouts_does() -> None:
    lines = [*dataset(2), dataset(1)[0], b"", orjson.dumps({"x": 1, "agent_ref": {"name": "b"}})]
    rows = materialize_rows(lines, agent=AGENT, num_repeats=2)
    keys = [(r["_ng_task_index"], r["_ng_rollout_index"], r["agent_ref"]["name"]) for r in rows]
    assert keys == [
        (0, 0, AGENT), (0, 1, AGENT), (1, 0, AGENT), (1, 1, AGENT),
        (0, 0, AGENT), (0, 1, AGENT),  # an identical row shares its task index
        (2, 0, "b"), (2, 1, "b"),
    ]  # fmt: skip
    assert episode_id(rows[3]) == "t1-r1"
    assert len(materialize_rows(lines, agent=AGENT, limit=1)) == 1
    with pytest.raises(ValueError, match="agent_ref"):
        materialize_rows(dataset(1))


def collector(world: World, agent: FakeAgent, output: Path, **options: Any) -> GymCollector:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=agent.app))
    return GymCollector(
        agents={AGENT: "http://agent.test"},
        output=output,
        transport=world.transport,
        trainer=world.trainer,
        restores=world.restores,
        signals=False,
        http=http,
        **{"run": RUN, "concurrency": 4, **options},
    )


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - the collector's progress, in another task
            await asyncio.sleep(0.01)


def written(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def test_a_collection_writes_nemo_gym_rollout_rows(world: World, tmp_path: Path) -> None:
    agent = FakeAgent()
    output = tmp_path / "rollouts.jsonl"
    rows = materialize_rows(dataset(3), agent=AGENT)
    report = await collector(world, agent, output).run(rows)
    assert (report.rows, report.written, report.complete) == (3, 3, True)
    assert report.checkpoints  # one before the first dispatch: a crash has one to restore
    out = sorted(written(output), key=episode_id)
    assert [r["reward"] for r in out] == [0.0, 1.0, 2.0]
    assert out[1]["agent_ref"] == {"name": AGENT} and out[1]["_ng_rollout_index"] == 0
    assert out[1]["response"] == {"output": [], "id": "resp"}
    assert agent.seen[0]["x-rolloutlog-capture-key"] in agent.seen[0]["cookie"]
    history = await world.trainer.episode_history(RUN, "t1-r0")
    kinds = [e["type"] for e in history["events"]]
    assert kinds == ["episode.started", "step.started", "step.boundary", "episode.finished"]
    assert await world.trainer.results(RUN, unacknowledged=True) == []
    again = await collector(world, agent, output).run(rows)  # nothing left to do
    assert (again.written, again.already_done) == (0, 3)


async def test_a_crash_resumes_from_the_checkpoint(world: World, tmp_path: Path) -> None:
    """Rows 1 and 2 are in flight at a checkpoint; row 3 finishes but the crash loses its row
    before it is written; the collector dies. Started again, it writes row 3 from the result
    the service kept, continues 1 and 2 under new capture keys and writes every row once."""
    agent = FakeAgent()
    agent.blocked = {1.0, 2.0}
    output = tmp_path / "rollouts.jsonl"
    rows = materialize_rows(dataset(5), agent=AGENT)
    first = collector(world, agent, output)
    lost = asyncio.Event()
    original = _Output.write

    def write(self: _Output, row: Any, failed: bool = False) -> None:
        if row.get("_ng_task_index") == 3:  # finished, the crash comes before the row is out
            lost.set()
            raise asyncio.CancelledError
        original(self, row, failed)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_Output, "write", write)
        running = asyncio.create_task(first.run(rows))
        await until(lambda: len(agent.waiting) == 2 and lost.is_set())
        await until(lambda: len(written(output)) == 2)
        checkpoint = await world.trainer.checkpoint(RUN)
        assert checkpoint.status == "committed"
        running.cancel()  # the crash
        with contextlib.suppress(asyncio.CancelledError):
            await running
    assert sorted(r["_ng_task_index"] for r in written(output)) == [0, 4]
    agent.release()
    second = collector(world, agent, output)
    report = await second.run(rows)
    assert (report.recovered, report.continued, report.already_done) == (1, 2, 2)
    out = written(output)
    assert Counter(episode_id(r) for r in out) == {f"t{i}-r0": 1 for i in range(5)}
    assert all(r["reward"] == r["_ng_task_index"] for r in out)
    continued = [s for s in agent.seen if s["x-rolloutlog-capture-key"].endswith("-a1")]
    assert sorted(s["x-rolloutlog-capture-key"] for s in continued) == ["t1-r0-a1", "t2-r0-a1"]
    assert all(s["x-rolloutlog-restore-id"] == str(report.restore_id) for s in continued)
    assert await world.trainer.results(RUN, unacknowledged=True) == []


async def test_a_gym_that_fails_interrupts_the_collection(world: World, tmp_path: Path) -> None:
    """A ``/run`` answered 5xx (or not at all) is a Gym that died: no failure row, the episode
    stays open, the collection stops; run again once the Gym is back, it finishes the rows."""
    agent = FakeAgent()
    agent.failing = {1.0}
    output = tmp_path / "rollouts.jsonl"
    rows = materialize_rows(dataset(3), agent=AGENT)
    report = await collector(world, agent, output, concurrency=1).run(rows)
    assert not report.complete and report.interrupted[0].startswith("t1-r0: 503")
    assert report.failed == 0 and not (tmp_path / "rollouts_failures.jsonl").read_bytes()
    assert {episode_id(r) for r in written(output)} == {"t0-r0"}  # dispatch stopped at t1-r0
    agent.failing = set()
    again = await collector(world, agent, output).run(rows)
    assert again.complete and (again.already_done, again.written) == (1, 2)
    assert sorted(r["reward"] for r in written(output)) == [0.0, 1.0, 2.0]


async def test_a_fork_collects_the_rows_in_flight_at_its_checkpoint(
    world: World, tmp_path: Path
) -> None:
    """Rows 1 and 2 are in flight at the source's checkpoint: a collector of the fork (its own
    agent: the source's is still busy with them) forks it and collects those two into its own
    output, the others not being the fork's; run again it is done, though the source's latest
    checkpoint moved on; a run that is no fork of that source is refused. The source then
    finishes all its own rows."""
    agent = FakeAgent()
    agent.blocked = {1.0, 2.0}
    rows = materialize_rows(dataset(4), agent=AGENT)
    source_output, fork_output = tmp_path / "a.jsonl", tmp_path / "fork.jsonl"
    source = asyncio.create_task(collector(world, agent, source_output).run(rows))
    await until(lambda: len(agent.waiting) == 2)
    await until(lambda: source_output.exists() and len(written(source_output)) == 2)
    checkpoint = await world.trainer.checkpoint(RUN)
    assert checkpoint.status == "committed"
    fork = {"run": "fork", "fork_from": RUN, "fork_checkpoint": "latest"}
    report = await collector(world, FakeAgent(), fork_output, **fork).run(rows)
    assert (report.continued, report.not_forked, report.written) == (2, 2, 2)
    assert sorted(r["reward"] for r in written(fork_output)) == [1.0, 2.0]
    assert (await world.trainer.get_run("fork"))["forked_from"]["run"] == RUN
    await world.trainer.checkpoint(RUN)  # "latest" is another checkpoint now
    again = await collector(world, FakeAgent(), fork_output, **fork).run(rows)
    assert (again.already_done, again.written, again.not_forked) == (2, 0, 2)
    await world.trainer.create_run("plain")
    with pytest.raises(RunExists):
        await collector(world, FakeAgent(), tmp_path / "p.jsonl", **{**fork, "run": "plain"}).run(
            rows
        )
    agent.release()
    assert (await source).written == 4
    assert sorted(r["reward"] for r in written(source_output)) == [0.0, 1.0, 2.0, 3.0]
