"""The results routes through a real server (``rolloutlog serve`` in a subprocess): the filters,
the roles, acknowledging twice, ``resume_run`` handing back exactly the unacknowledged results
and never dispatching their episodes again, and an episode's history showing its result."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rolloutlog.trainer import TrainerClient, resume_run_sync
from tests import factories as f
from tests.api.conftest import TOKENS, bearer, wire
from tests.api.test_e2e import Server, running_server

pytestmark = pytest.mark.slow

RUN = "res"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with running_server(tmp_path) as running:
        yield running


def get(server: Server, path: str, role: str = "analyst", **params: Any) -> httpx.Response:
    return httpx.get(server.url + path, params=params, headers=bearer(role), timeout=30)


def results(server: Server, role: str = "analyst", **params: Any) -> list[dict[str, Any]]:
    response = get(server, f"/v1/runs/{RUN}/results", role, **params)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [orjson.loads(line) for line in response.content.splitlines() if line]


def ack(server: Server, episodes: list[str], role: str = "trainer") -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/runs/{RUN}/results/ack",
        json={"episodes": episodes},
        headers=bearer(role),
        timeout=30,
    )


def append(server: Server, *events: Any) -> None:
    response = httpx.post(
        f"{server.url}/v1/runs/{RUN}/events",
        json=wire(*events),
        headers=bearer("participant"),
        timeout=30,
    )
    assert response.status_code == 200, response.text


def test_results_filters_roles_acknowledgement_and_resume(server: Server) -> None:
    with TrainerClient(server.url, token=TOKENS["trainer"]) as trainer:
        trainer.create_run(RUN, partitions=4)
        registered = httpx.post(
            f"{server.url}/v1/runs/{RUN}/participants",
            json={"id": "env-0", "kind": "environment"},
            headers=bearer("participant"),
        )
        assert registered.status_code == 201, registered.text
        trainer.take_over(RUN)
        for episode in ("a", "b", "c", "d"):
            append(server, f.started(episode), f.boundary(episode, "seed", {"turn": 1}))
        append(server, f.finished("b", 0.5, {"answer": "b", "tokens": [1, 2]}))
        checkpoint = trainer.checkpoint(RUN)
        assert checkpoint.counts == {"continue": 3, "restart": 0, "finished": 1}
        # After the cut: c finishes, and "late" begins and finishes.
        append(server, f.finished("c", 0.25, {"answer": "c"}))
        append(server, f.started("late"), f.finished("late", 0.75))

        every = results(server)
        assert [(r["episode"], r["reward"], r["attempt"], r["capture_key"]) for r in every] == [
            ("b", 0.5, 0, "b"),
            ("c", 0.25, 0, "c"),
            ("late", 0.75, 0, "late"),
        ]
        assert every[0]["result"] == {"answer": "b", "tokens": [1, 2]}
        assert every[2]["result"] is None and every[0]["acknowledged"] is False
        assert {"finished_offset", "partition", "ts"} <= set(every[0])
        assert results(server, "trainer") == every  # a trainer token reads as an analyst
        since = results(server, since_checkpoint=checkpoint.checkpoint_id)
        assert [r["episode"] for r in since] == ["c", "late"]
        assert [r["episode"] for r in results(server, episodes="late,b")] == ["b", "late"]
        repeated = httpx.get(
            f"{server.url}/v1/runs/{RUN}/results",
            params=[("episodes", "c"), ("episodes", "nope")],
            headers=bearer("analyst"),
        )
        assert [orjson.loads(x)["episode"] for x in repeated.content.splitlines()] == ["c"]
        for bad, status, code in (
            (get(server, f"/v1/runs/{RUN}/results", "participant"), 403, "forbidden"),
            (get(server, f"/v1/runs/{RUN}/results", since_checkpoint=9), 404, "unknown_checkpoint"),
            (get(server, f"/v1/runs/{RUN}/results", episodes="x-a1"), 400, "invalid_request"),
            (get(server, "/v1/runs/nope/results"), 404, "unknown_run"),
            (ack(server, ["b"], "analyst"), 403, "forbidden"),
            (ack(server, []), 400, "invalid_request"),
        ):
            assert (bad.status_code, bad.json()["error"]["code"]) == (status, code), bad.text

        # Acknowledging twice changes nothing; an unknown episode is reported, not acknowledged.
        first = ack(server, ["b", "nope"])
        assert first.json() == {"acknowledged": 1, "already": 0, "unknown": ["nope"]}
        assert ack(server, ["b"]).json() == {"acknowledged": 0, "already": 1, "unknown": []}
        pending = results(server, unacknowledged="true")
        assert [r["episode"] for r in pending] == ["c", "late"]

        # The trainer crashed without c's and late's replies: resume hands them back and
        # dispatches neither again.
        plan = resume_run_sync(trainer, RUN)
        assert [(r.episode, r.reward) for r in plan.results] == [("c", 0.25), ("late", 0.75)]
        assert plan.results[0].result == {"answer": "c"}
        assert sorted(d.episode for d in plan.dispatch) == ["a", "d"]
        assert sorted(plan.excluded) == ["c", "late"]
        assert plan.finished == ("b",)
        assert plan.restore is not None and plan.restore.raw["unacknowledged_results"] == 2
        history = get(server, f"/v1/runs/{RUN}/episodes/c").json()
        assert (history["result"]["reward"], history["result"]["acknowledged"]) == (0.25, False)

        assert trainer.ack_results(RUN, [r.episode for r in plan.results]) == 2
        assert trainer.ack_results(RUN, ["c", "late"]) == 0
        assert trainer.results(RUN, unacknowledged=True) == []
        assert [r.episode for r in trainer.results(RUN, episodes=["c", "b"])] == ["b", "c"]
        # An acknowledged result never comes back, and its rollout is still not dispatched.
        again = resume_run_sync(trainer, RUN)
        assert again.results == ()
        assert sorted(d.episode for d in again.dispatch) == ["a", "d"]
        assert again.restore is not None and again.restore.raw["unacknowledged_results"] == 0
