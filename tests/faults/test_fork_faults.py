"""Forks under faults, on the embedded log (Tansu cannot trim): the source trimmed under a fork's
copy, a fork of a fork, the source deleted after the fork."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path
from typing import Any

from tests import factories as f
from tests.api.conftest import Api, open_api, settings_for

SOURCE, FORK = "src", "fork-1"
EPISODES = 1600
PARTITIONS = 8


def log_file(data: Path, run: str) -> Path:
    return data / "log" / f"{run}.sqlite3"


def records_in(path: Path) -> int:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        return int(conn.execute("SELECT coalesce(sum(count), 0) FROM segments").fetchone()[0])
    finally:
        conn.close()


def has_segments(path: Path) -> bool:
    """Whether the log file exists with its tables (the copy's appends are next)."""
    if not path.exists():
        return False
    try:
        records_in(path)
    except sqlite3.OperationalError:
        return False
    return True


def trimmed_partitions(path: Path) -> int:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        row = conn.execute("SELECT count(*) FROM partitions WHERE start_offset > 0").fetchone()
        return int(row[0])
    finally:
        conn.close()


async def many_live_episodes(api: Api) -> list[str]:
    api.run = SOURCE
    await api.create_run(SOURCE, partitions=PARTITIONS)
    await api.register()
    await api.take_over()
    names = [f"e{i:04d}" for i in range(EPISODES)]
    for start in range(0, EPISODES, 400):
        batch = names[start : start + 400]
        await api.append(
            *(e for n in batch for e in (f.started(n), f.boundary(n, "seed", {"turn": n})))
        )
    return names


async def test_a_fork_whose_checkpoint_is_trimmed_under_its_copy_is_refused_whole(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    async with open_api(settings_for(data)) as api:
        names = await many_live_episodes(api)
        first = await api.checkpoint()
        # The episodes finish and a new one begins: their records are needed only by the
        # first checkpoint, which the fork names.
        for start in range(0, EPISODES, 400):
            await api.append(*(f.finished(n) for n in names[start : start + 400]))
        await api.append(f.started("new-0"), f.boundary("new-0", "seed", {"turn": 0}))
        await api.checkpoint()
    # (A restarted service's manifests say exactly where replays start: its trims go as far.)
    async with open_api(settings_for(data)) as api:
        api.run = SOURCE
        await api.take_over()
        body = {"run": FORK, "fork": {"run": SOURCE, "checkpoint_id": first["checkpoint_id"]}}
        forking = asyncio.create_task(api.call("POST", "/v1/runs", "trainer", json=body))
        # Hold the fork's log as soon as it exists: the copy stops at its next append.
        target = log_file(data, FORK)
        while not has_segments(target):
            assert not forking.done(), forking.result().text
            await asyncio.sleep(0.001)
        hold = sqlite3.connect(target, isolation_level=None, timeout=30)
        try:
            hold.execute("BEGIN IMMEDIATE")
            copied = records_in(target)
            assert copied < 2 * EPISODES, "the copy was over before the hold"
            # Meanwhile the source goes on: two checkpoints later the forked one has expired
            # and the source's log is trimmed below the new episode, under the copy.
            await api.checkpoint()
            await api.checkpoint()
            source_log = log_file(data, SOURCE)
            for _ in range(1000):
                if trimmed_partitions(source_log) == PARTITIONS:
                    break
                await asyncio.sleep(0.01)
            assert trimmed_partitions(source_log) == PARTITIONS
            assert not forking.done()
        finally:
            with contextlib.suppress(sqlite3.Error):
                hold.execute("ROLLBACK")
            hold.close()
        refused = await forking
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["code"] == "unknown_checkpoint"
        assert "expired" in refused.json()["error"]["message"]
        # Nothing of it stays: no run, no log, and the name is free for a fork of a newer one.
        assert (await api.call("GET", f"/v1/runs/{FORK}", "analyst")).status_code == 404
        assert not target.exists()
        again = await api.call(
            "POST", "/v1/runs", "trainer", 201, json={"run": FORK, "fork": {"run": SOURCE}}
        )
        assert again.json()["forked_from"]["checkpoint_id"] == first["checkpoint_id"] + 3
        manifest = await api.call("GET", f"/v1/runs/{FORK}/checkpoints/1/manifest", "analyst")
        assert [e["episode"] for e in manifest.json()["episodes"]] == ["new-0"]
        state = await environment_state(api, FORK, "new-0", "checkpoint=1")
        assert state == ({"turn": 0}, 0)


async def environment_state(api: Api, run: str, episode: str, query: str) -> Any:
    url = f"/v1/runs/{run}/episodes/{episode}/projection?{query}"
    body = (await api.call("GET", url, "participant", 200)).json()
    return body["boundaries"]["environment"]["state"], body["attempt"]


async def test_a_fork_of_a_fork_and_sources_deleted_after_them(tmp_path: Path) -> None:
    """A fork's fork continues from the fork's cuts (its own restore and progress included);
    deleting the source and then the first fork leaves the second whole."""
    async with open_api(settings_for(tmp_path / "data")) as api:
        api.run = SOURCE
        await api.create_run(SOURCE, partitions=4)
        await api.register()
        await api.take_over()
        await api.append(
            f.started("x"),
            f.boundary("x", "seed", {"turn": 1}),
            f.started("y"),
            f.boundary("y", "seed", {"turn": 1}),
        )
        await api.checkpoint()
        await api.call(
            "POST", "/v1/runs", "trainer", 201, json={"run": FORK, "fork": {"run": SOURCE}}
        )

        # The first fork restores, progresses in its own attempt, checkpoints.
        api.run = FORK
        epoch = await api.register()
        await api.take_over()
        restored = await api.restore()
        assert restored["counts"]["continue"] == 2
        who = {"attempt": 1, "who": f.participant(epoch=epoch)}
        await api.append(f.boundary("x", "invoke_agent", {"turn": 2}, **who))
        await api.checkpoint()

        second = await api.call(
            "POST", "/v1/runs", "trainer", 201, json={"run": "fork-2", "fork": {"run": FORK}}
        )
        assert second.json()["forked_from"] == {
            "run": FORK,
            "checkpoint_id": 2,
            "at": second.json()["forked_from"]["at"],
        }
        assert await environment_state(api, "fork-2", "x", "checkpoint=1") == ({"turn": 2}, 1)
        assert await environment_state(api, "fork-2", "y", "checkpoint=1") == ({"turn": 1}, 1)

        # The source and then the first fork go; the second fork restores and reads alone.
        await api.call("DELETE", f"/v1/runs/{SOURCE}", "trainer", 200)
        await api.call("DELETE", f"/v1/runs/{FORK}", "trainer", 200)
        api.run = "fork-2"
        epoch = await api.register()
        await api.take_over()
        restored = await api.restore()
        assert restored["counts"] == {"continue": 2, "restart": 0, "excluded": 0}
        restore_id = restored["restore_id"]
        assert await environment_state(api, "fork-2", "x", f"restore={restore_id}") == (
            {"turn": 2},
            2,
        )
        view = (await api.call("GET", "/v1/runs/fork-2", "analyst", 200)).json()
        assert view["forked_from"]["run"] == FORK
        listed = (await api.call("GET", "/v1/runs", "analyst", 200)).json()["runs"]
        assert [r["run"] for r in listed] == ["fork-2"]
