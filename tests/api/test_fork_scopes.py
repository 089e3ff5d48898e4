"""Forks and run-scoped tokens, through a real server: a fork needs the trainer role on both
its source and itself; a source lists only the forks the asking token may see."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests import factories as f
from tests.api.conftest import TOKENS, bearer, wire
from tests.api.test_auth import SCOPED, scoped_server
from tests.api.test_cli import process

pytestmark = pytest.mark.slow


def _as(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _source(client: httpx.Client, run: str) -> None:
    """``run`` with a live episode and a committed checkpoint (as admin)."""
    for path, body, role in (
        ("/v1/runs", {"run": run, "partitions": 2}, "admin"),
        (f"/v1/runs/{run}/participants", {"id": "env-0", "kind": "environment"}, "admin"),
    ):
        assert client.post(path, json=body, headers=bearer(role)).status_code == 201
    epoch = client.post(f"/v1/runs/{run}/controller", headers=bearer("admin")).json()
    events = wire(f.started("e1"), f.boundary("e1", "seed", {"turn": 1}))
    assert client.post(f"/v1/runs/{run}/events", json=events, headers=bearer("admin")).is_success
    body = {"controller_epoch": epoch["controller_epoch"]}
    assert client.post(f"/v1/runs/{run}/checkpoints", json=body, headers=bearer("admin")).is_success


def test_a_fork_needs_the_trainer_role_on_its_source_and_itself(tmp_path: Path) -> None:
    with scoped_server(tmp_path) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        _source(c, "exp-src")
        _source(c, "other-src")
        trainer = _as(SCOPED["trainer"])

        def fork(run: str, source: str, headers: dict[str, str]) -> httpx.Response:
            return c.post("/v1/runs", json={"run": run, "fork": {"run": source}}, headers=headers)

        assert fork("exp-fork", "exp-src", trainer).status_code == 201
        for run, source in (("exp-fork-2", "other-src"), ("other-fork", "exp-src")):
            refused = fork(run, source, trainer)
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["code"] == "forbidden"
            assert c.get(f"/v1/runs/{run}", headers=bearer("admin")).status_code == 404
        assert fork("other-fork", "exp-src", _as(TOKENS["trainer"])).status_code == 201

        # The source lists its forks: all of them to an unscoped token, the scope's to another.
        everyone = c.get("/v1/runs/exp-src", headers=bearer("analyst")).json()["forks"]
        assert sorted(x["run"] for x in everyone) == ["exp-fork", "other-fork"]
        scoped = c.get("/v1/runs/exp-src", headers=_as(SCOPED["analyst"])).json()["forks"]
        assert [x["run"] for x in scoped] == ["exp-fork"]


def test_a_scoped_token_is_not_told_the_name_of_a_source_out_of_its_scope(
    tmp_path: Path,
) -> None:
    """A fork the token reads, of a source it holds no role on: the fork's view, its row in
    the listing and its episode's history say it is a fork, of which checkpoint and when, with
    the source's name left out (``run`` null), and so does ``rolloutlog runs show``; a token
    that holds the source reads the name."""
    with scoped_server(tmp_path) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        _source(c, "other-src")
        made = c.post(
            "/v1/runs",
            json={"run": "exp-fork", "fork": {"run": "other-src"}},
            headers=_as(TOKENS["trainer"]),
        )
        assert made.status_code == 201, made.text
        full = made.json()["forked_from"]
        assert full["run"] == "other-src"
        hidden = {**full, "run": None}
        paths = ("/v1/runs/exp-fork", "/v1/runs", "/v1/runs/exp-fork/episodes/e1")
        for token in (SCOPED["analyst"], SCOPED["trainer"], SCOPED["admin"]):
            replies = [c.get(path, headers=_as(token)) for path in paths]
            for reply in replies:
                assert reply.status_code == 200, reply.text
                assert "other-src" not in reply.text, reply.text
            view, listing, history = (reply.json() for reply in replies)
            assert view["forked_from"] == hidden
            assert [r["forked_from"] for r in listing["runs"]] == [hidden]
            origin = history["forked_from"]
            assert origin["run"] is None and origin["checkpoint_id"] == full["checkpoint_id"]
            assert (origin["attempt"], origin["capture_key"]) == (0, "e1")
            sourced = [a for a in history["attempts"] if a["in_source"]]
            assert sourced and all(
                a["why"].startswith("in the source run before the fork") for a in sourced
            )
        # A token that holds the source (any role on it) reads its name.
        for token in (TOKENS["analyst"], TOKENS["admin"]):
            view = c.get("/v1/runs/exp-fork", headers=_as(token)).json()
            assert view["forked_from"] == full
            history = c.get("/v1/runs/exp-fork/episodes/e1", headers=_as(token)).json()
            assert history["forked_from"]["run"] == "other-src"

        shown = process(
            None,
            "runs",
            "show",
            "exp-fork",
            ROLLOUTLOG_URL=server.url,
            ROLLOUTLOG_TOKEN=SCOPED["analyst"],
        )
        assert shown.status == 0, shown.err
        assert "other-src" not in shown.out and "None" not in shown.out, shown.out
        expected = (
            f"forked from checkpoint {full['checkpoint_id']} of a run out of this token's scope"
        )
        assert expected.split() in [row.split() for row in shown.lines()], shown.out
