"""Forks over REST, on the embedded deployment: a run created from another run's committed
checkpoint holds that checkpoint's live episodes as its own checkpoint 1, continues them in its
own restores, and never reads its source again (the source may go on, or be deleted)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson

from rolloutlog.api import Tokens
from tests import factories as f
from tests._services import ROOT
from tests.api.conftest import TOKENS, Api, open_api, settings_for

SOURCE, FORK = "src", "fork-1"


def code(response: Any) -> str:
    return str(response.json()["error"]["code"])


async def fork(api: Api, run: str = FORK, expect: int = 201, **spec: Any) -> dict[str, Any]:
    spec.setdefault("run", SOURCE)
    response = await api.call(
        "POST", "/v1/runs", "trainer", expect, json={"run": run, "fork": spec}
    )
    body: dict[str, Any] = response.json()
    return body


async def projection(api: Api, run: str, episode: str, query: str) -> dict[str, Any]:
    url = f"/v1/runs/{run}/episodes/{episode}/projection?{query}"
    body: dict[str, Any] = (await api.call("GET", url, "participant", 200)).json()
    return body


def history_doc() -> str:
    """docs/api.md's paragraph on an episode's history."""
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    return text.split("**An episode's history**", 1)[1].split("\n\n", 1)[0]


def state_of(p: dict[str, Any]) -> dict[str, Any]:
    """What a projection carries on to the next attempt (not where it sits in which log)."""
    keys = ("task", "task_digest", "boundaries", "sessions", "ledger", "generation_cut")
    return {key: p.get(key) for key in keys}


async def build_source(api: Api) -> None:
    """A source run whose latest checkpoint holds, each continued by a restore as attempt 1:
    ``live`` (ledger rows, a session, a generation cut in its tail), ``again`` (more progress),
    ``done`` (finished) and ``other`` (no progress since)."""
    api.run = SOURCE
    await api.create_run(SOURCE, partitions=4)
    for pid, kind in (("env-0", "environment"), ("policy-0", "policy"), ("res-0", "resources")):
        await api.register(pid, kind)
    await api.take_over()
    root = f.ledger_row("live", "c1", [1, 2, 3])
    await api.append(
        f.started("live"),
        f.session_started("live", mode="exported"),
        f.session_state("live", state={"counter": 7}),
        root,
        f.boundary("live", "invoke_agent", {"turn": 1}),
        f.chunk("live", "c2", 0, 8),
        f.started("again"),
        f.boundary("again", "seed", {"turn": 1}),
        f.started("done"),
        f.boundary("done", "seed", {"turn": 1}),
        f.started("other"),
        f.boundary("other", "seed", {"turn": 1}),
        f.step_started("other", "invoke_agent"),
    )
    await api.checkpoint()
    restored = await api.restore()
    assert restored["counts"]["continue"] == 4  # every episode goes on as attempt 1
    parent = {"call_id": "c1", "cum_len": 3, "digest": f.ledger_digest("", [1, 2, 3])}
    await api.append(
        f.boundary("again", "invoke_agent", {"turn": 2}, attempt=1),
        f.boundary("again", "verify", {"turn": 3}, attempt=1),
        f.session_state("live", state={"counter": 9}, attempt=1),
        f.ledger_row("live", "c3", [4, 5], parent=parent, attempt=1),
        f.boundary("live", "invoke_agent", {"turn": 2}, attempt=1),
        f.chunk("live", "c4", 0, 8, attempt=1),
        f.finished("done", attempt=1, reward=0.5),
    )
    await api.checkpoint()


async def test_a_fork_holds_the_sources_live_episodes_and_continues_them_as_its_own(
    tmp_path: Path,
) -> None:
    async with open_api(settings_for(tmp_path / "data")) as api:
        await build_source(api)
        latest = (
            await api.call("GET", f"/v1/runs/{SOURCE}/checkpoints/latest", "trainer", 200)
        ).json()
        source_manifest = (
            await api.call(
                "GET",
                f"/v1/runs/{SOURCE}/checkpoints/{latest['checkpoint_id']}/manifest",
                "trainer",
                200,
            )
        ).json()["episodes"]
        live = sorted(e["episode"] for e in source_manifest if e["action"] != "finished")
        assert "done" not in live and {"live", "again", "other"} <= set(live)

        created = await fork(api, checkpoint_id="latest")
        assert created["partitions"] == 4
        # The staging keys of the fork's checkpoint 1, listed as a checkpoint's reply lists
        # them: the source's keys of the episodes forked, unrenamed (its ledger rows name them).
        first = await api.service.catalog.load_manifest(FORK, 1)
        keys = {key for entry in first for key in entry.staging_keys}
        assert keys == {"stage-live-c1", "stage-live-c3"}
        assert sorted(created["staging_keys"]) == sorted(keys)
        assert len(created["staging_keys"]) == len(keys)
        assert created["forked_from"]["run"] == SOURCE
        assert created["forked_from"]["checkpoint_id"] == latest["checkpoint_id"]
        assert created["forked_from"]["at"] is not None

        # The fork's own checkpoint 1 is the source's, restricted to its live episodes.
        mine = (await api.call("GET", f"/v1/runs/{FORK}/checkpoints/1", "trainer", 200)).json()
        assert mine["status"] == "committed"
        manifest = (
            await api.call("GET", f"/v1/runs/{FORK}/checkpoints/1/manifest", "trainer", 200)
        ).json()["episodes"]
        assert sorted(e["episode"] for e in manifest) == live
        by_episode = {e["episode"]: e for e in source_manifest}
        for entry in manifest:
            assert entry["attempt"] == by_episode[entry["episode"]]["attempt"]
            assert entry["action"] == by_episode[entry["episode"]]["action"]
        states = {}
        for episode in live:
            theirs = await projection(api, SOURCE, episode, f"checkpoint={latest['checkpoint_id']}")
            ours = await projection(api, FORK, episode, "checkpoint=1")
            assert state_of(ours) == state_of(theirs), episode
            states[episode] = state_of(theirs)

        # Lineage both ways; a run that is no fork says so.
        view = (await api.call("GET", f"/v1/runs/{FORK}", "analyst", 200)).json()
        assert view["forked_from"] == created["forked_from"]
        source_view = (await api.call("GET", f"/v1/runs/{SOURCE}", "analyst", 200)).json()
        assert source_view["forked_from"] is None
        assert [f_["run"] for f_ in source_view["forks"]] == [FORK]

        # The same fork again: 200, the same; another fork under the name: 409.
        again = await fork(api, expect=200, checkpoint_id="latest")
        assert again["forked_from"] == created["forked_from"]
        assert sorted(again["staging_keys"]) == sorted(keys)
        other = await api.call(
            "POST",
            "/v1/runs",
            "trainer",
            409,
            json={"run": FORK, "fork": {"run": SOURCE, "checkpoint_id": 1}},
        )
        assert code(other) == "run_exists"
        bad = await api.call(
            "POST",
            "/v1/runs",
            "trainer",
            400,
            json={"run": "fork-2", "partitions": 8, "fork": {"run": SOURCE}},
        )
        assert code(bad) == "invalid_request"
        assert code(await api.call("GET", "/v1/runs/fork-2", "analyst", 404)) == "unknown_run"

        # The fork's restore: its own restore id 1, the next attempts, its own participants.
        api.run = FORK
        epoch = await api.register("env-0", "environment")
        assert epoch > 1  # above the copied records' epochs
        await api.take_over()
        restored = await api.restore()
        assert restored["restore_id"] == 1
        assert restored["counts"] == {"continue": len(live), "restart": 0, "excluded": 0}
        plan = (
            await api.call("GET", f"/v1/runs/{FORK}/restores/1/episodes", "trainer", 200)
        ).json()["episodes"]
        for entry in plan:
            assert entry["previous_attempt"] == by_episode[entry["episode"]]["attempt"]
            assert entry["attempt"] == entry["previous_attempt"] + 1
        for episode in live:
            theirs = await projection(api, SOURCE, episode, f"checkpoint={latest['checkpoint_id']}")
            ours = await projection(api, FORK, episode, "restore=1")
            assert state_of(ours) == state_of(theirs), episode
            assert ours["attempt"] == theirs["attempt"] + 1

        # The episode's history in the fork says where it came from.
        history = (await api.call("GET", f"/v1/runs/{FORK}/episodes/again", "analyst", 200)).json()
        assert history["forked_from"]["run"] == SOURCE
        assert history["forked_from"]["checkpoint_id"] == latest["checkpoint_id"]
        assert history["forked_from"]["capture_key"] == "again-a1"
        attempts = {a["attempt"]: a for a in history["attempts"]}
        assert attempts[0]["in_source"] and attempts[1]["in_source"]
        assert not attempts[2]["in_source"] and attempts[2]["restore_id"] == 1
        assert attempts[1]["why"].startswith(f"in run {SOURCE!r} before the fork")
        documented = history_doc()  # docs/api.md names what an analyst reads here
        for key in [*history["forked_from"], "forked_from", "in_source"]:
            assert f'"{key}"' in documented or f"`{key}`" in documented, key
        source_history = (
            await api.call("GET", f"/v1/runs/{SOURCE}/episodes/again", "analyst", 200)
        ).json()
        assert source_history["forked_from"] is None

        # The source goes on untouched, and is then deleted: the fork does not notice.
        api.run = SOURCE
        await api.append(f.finished("other", attempt=1, reward=1.0))  # a's own
        await api.checkpoint()
        await api.call("DELETE", f"/v1/runs/{SOURCE}", "trainer", 200)
        api.run = FORK
        live_one = plan[0]
        step = {"attempt": live_one["attempt"], "who": f.participant(epoch=epoch)}
        await api.append(
            f.boundary(live_one["episode"], "verify", {"turn": 9}, **step),
            f.finished(live_one["episode"], reward=2.0, **step),
        )
        after = await api.checkpoint()
        assert after["counts"]["finished"] == 1
        response = await api.call("GET", f"/v1/runs/{FORK}/results", "trainer", 200)
        results = [orjson.loads(line) for line in response.text.splitlines()]
        assert [(r["episode"], r["reward"]) for r in results] == [(live_one["episode"], 2.0)]
        view = (await api.call("GET", f"/v1/runs/{FORK}", "analyst", 200)).json()
        assert view["forked_from"]["run"] == SOURCE  # where it came from, though gone
        # Its checkpoint's projections are read from its own log (the source's is gone).
        for episode in live:
            ours = await projection(api, FORK, episode, "checkpoint=1")
            assert state_of(ours) == states[episode], episode


async def test_a_fork_of_chosen_episodes_and_what_it_refuses(api: Api) -> None:
    await build_source(api)
    created = await fork(api, episodes=["live", "again", "other"], exclude=["other"])
    manifest = (
        await api.call("GET", f"/v1/runs/{FORK}/checkpoints/1/manifest", "trainer", 200)
    ).json()["episodes"]
    assert sorted(e["episode"] for e in manifest) == ["again", "live"]
    assert created["counts"]["continue"] == 2
    assert sorted(created["staging_keys"]) == ["stage-live-c1", "stage-live-c3"]
    # Without the episode whose ledger rows have keys, the fork's checkpoint 1 lists none.
    keyless = await fork(api, "fork-3", exclude=["live"])
    assert keyless["staging_keys"] == []
    # Finished or unknown episodes, an unknown source or checkpoint: nothing is created.
    for spec, status, error in (
        ({"episodes": ["done"]}, 404, "unknown_episode"),
        ({"exclude": ["ghost"]}, 404, "unknown_episode"),
        ({"run": "nowhere"}, 404, "unknown_run"),
        ({"checkpoint_id": 77}, 404, "unknown_checkpoint"),
    ):
        response = await api.call(
            "POST",
            "/v1/runs",
            "trainer",
            status,
            json={"run": "fork-x", "fork": {"run": SOURCE, **spec}},
        )
        assert code(response) == error, spec
        assert code(await api.call("GET", "/v1/runs/fork-x", "analyst", 404)) == "unknown_run"
    listed = (await api.call("GET", "/v1/runs", "analyst", 200)).json()["runs"]
    assert sorted(r["run"] for r in listed) == [FORK, "fork-3", SOURCE]


async def source_with_an_unfinished_fork(api: Api) -> None:
    """``build_source`` and a fork's first step (its claim), left as a fork whose service died
    before its commit leaves it."""
    await build_source(api)
    await api.service.catalog.claim_fork(
        FORK,
        source=SOURCE,
        checkpoint_id=1,
        partitions=4,
        log_url=api.service.log.url,
        request={"run": SOURCE, "checkpoint_id": 1, "episodes": None, "exclude": []},
    )


async def test_a_plain_run_under_a_name_being_forked_is_refused_run_exists(api: Api) -> None:
    await source_with_an_unfinished_fork(api)
    for body in ({"run": FORK}, {"run": FORK, "partitions": 4}):
        response = await api.call("POST", "/v1/runs", "trainer", 409, json=body)
        assert code(response) == "run_exists"
        details = response.json()["error"]["details"]
        assert details["being_forked"] is True
        assert details["settings"]["fork"]["existing"]["run"] == SOURCE
    # Still unseen, still the fork's: the same fork asked goes on and creates it.
    assert code(await api.call("GET", f"/v1/runs/{FORK}", "analyst", 404)) == "unknown_run"
    created = await fork(api, expect=201, checkpoint_id=1)
    assert created["forked_from"]["checkpoint_id"] == 1


async def test_a_name_being_forked_is_refused_without_the_source_to_a_token_out_of_its_scope(
    tmp_path: Path,
) -> None:
    """The refusal of a plain run under a name being forked names the fork's source only to a
    token that holds a role on it (as ``forked_from`` does)."""
    scoped = "trainer-of-fork-runs-01"
    tokens = {**TOKENS, "trainer": [TOKENS["trainer"], {"token": scoped, "runs": ["fork-*"]}]}
    settings = settings_for(tmp_path / "data")
    settings = dataclasses.replace(settings, tokens=Tokens.from_mapping(tokens, "test"))
    async with open_api(settings) as api:
        await source_with_an_unfinished_fork(api)
        for token, shown in ((scoped, None), (TOKENS["trainer"], SOURCE)):
            response = await api.client.post(
                "/v1/runs", json={"run": FORK}, headers={"Authorization": f"Bearer {token}"}
            )
            assert response.status_code == 409, response.text
            error = response.json()["error"]
            assert error["code"] == "run_exists"
            assert error["details"]["being_forked"] is True
            assert error["details"]["settings"]["fork"]["existing"]["run"] == shown
            assert (SOURCE in error["message"]) is (shown is not None)


async def test_a_forks_restore_continues_and_restarts_as_its_sources_would_for_the_same_reasons(
    api: Api,
) -> None:
    """The fork's checkpoint 1 and its first restore carry the source's actions and restart
    reasons for the same cut: an episode whose restart-only session was open there restarts in
    both runs, for the same reason, and the other continues in both."""
    api.run = SOURCE
    await api.create_run(SOURCE, partitions=4)
    await api.register()
    await api.register("res-0", "resources")
    await api.take_over()
    await api.append(
        f.started("goes-on"),
        f.boundary("goes-on", "seed", {"turn": 1}),
        f.started("starts-over"),
        f.session_started("starts-over", "s1", "restart_only"),
        f.boundary("starts-over", "seed", {"turn": 1}),
    )
    checkpoint = await api.checkpoint()
    await fork(api, checkpoint_id=checkpoint["checkpoint_id"])

    async def entries(url: str) -> dict[str, tuple[str, str | None]]:
        body = (await api.call("GET", url, "trainer", 200)).json()
        return {e["episode"]: (e["action"], e["reason"]) for e in body["episodes"]}

    manifest = f"/v1/runs/{SOURCE}/checkpoints/{checkpoint['checkpoint_id']}/manifest"
    theirs = await entries(manifest)
    assert await entries(f"/v1/runs/{FORK}/checkpoints/1/manifest") == theirs
    restored = {}
    for run in (SOURCE, FORK):
        api.run = run
        await api.take_over()
        restore = await api.restore(
            checkpoint_id=checkpoint["checkpoint_id"] if run == SOURCE else 1
        )
        restored[run] = await entries(f"/v1/runs/{run}/restores/{restore['restore_id']}/episodes")
    assert restored[FORK] == restored[SOURCE]
    action, reason = restored[FORK]["starts-over"]
    assert action == "restart" and reason, restored
    assert restored[FORK]["goes-on"] == ("continue", None)
