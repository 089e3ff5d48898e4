"""Tokens scoped to runs from the clients' side, through a real server: a scoped token's run
listing (paged), the CLI with a scoped token, and ``--metrics-auth``: ``/metrics`` and
``/readyz`` name no run to an anonymous caller and only its runs to a scoped token. The
route x role x scope matrix is in tests/api/test_auth.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rolloutlog.api.cli import main
from rolloutlog.api.cli._main import EXIT_REFUSED
from tests import factories as f
from tests.api.conftest import TOKENS, bearer, wire
from tests.api.test_auth import SCOPED, scoped_server
from tests.api.test_e2e import Server

pytestmark = pytest.mark.slow

#: Runs in the scope of ``SCOPED`` (``exp-*``, ``exact-run``) and out of it.
INSIDE = ("exact-run", "exp-a", "exp-b", "exp-c")
OUTSIDE = ("aaa-first", "exact-run-2", "exp", "other", "zzz-last")


def _as(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _seed(client: httpx.Client, runs: tuple[str, ...]) -> None:
    """Each run with an environment and a live episode (so that its projector reports it)."""
    for run in runs:
        made = client.post("/v1/runs", json={"run": run, "partitions": 2}, headers=bearer("admin"))
        assert made.status_code == 201, made.text
        registered = client.post(
            f"/v1/runs/{run}/participants",
            json={"id": "env-0", "kind": "environment"},
            headers=bearer("participant"),
        )
        assert registered.status_code == 201, registered.text
        events = wire(f.started("ep"), f.boundary("ep", "seed", {"turn": 1}))
        appended = client.post(f"/v1/runs/{run}/events", json=events, headers=bearer("participant"))
        assert appended.status_code == 200, appended.text


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, httpx.Client]]:
    """A server with ``--metrics-auth``, holding the runs ``INSIDE`` and ``OUTSIDE``."""
    with (
        scoped_server(tmp_path_factory.mktemp("guarded"), "--metrics-auth") as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        _seed(client, INSIDE + OUTSIDE)
        yield server, client


def _listed(client: httpx.Client, token: str, limit: int) -> list[str]:
    runs: list[str] = []
    after = None
    while True:
        params: dict[str, str | int] = {"limit": limit, **({"after": after} if after else {})}
        page = client.get("/v1/runs", params=params, headers=_as(token))
        assert page.status_code == 200, page.text
        runs += [r["run"] for r in page.json()["runs"]]
        after = page.json()["next_after"]
        if after is None:
            return runs


def test_a_scoped_token_lists_its_runs_only_page_by_page(
    guarded: tuple[Server, httpx.Client],
) -> None:
    _, client = guarded
    everything = sorted(INSIDE + OUTSIDE)
    for limit in (1, 2, 3, 100):
        assert _listed(client, TOKENS["analyst"], limit) == everything
        for role in ("analyst", "trainer", "admin"):
            assert _listed(client, SCOPED[role], limit) == sorted(INSIDE), (role, limit)
    denied = client.get("/v1/runs", headers=_as(SCOPED["participant"]))
    assert denied.status_code == 403  # a participant never lists runs, scoped or not


def test_the_cli_with_a_scoped_token(
    guarded: tuple[Server, httpx.Client], capsys: pytest.CaptureFixture[str]
) -> None:
    server, client = guarded

    def cli(role: str, *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        status = main([*args, "--url", server.url, "--token", SCOPED[role]])
        done = capsys.readouterr()
        return status, done.out, done.err

    status, out, _ = cli("analyst", "runs")
    assert status == 0
    assert [line.split()[0] for line in out.splitlines()[1:]] == sorted(INSIDE)
    status, out, _ = cli("analyst", "runs", "show", "exp-a")
    assert (status, out.splitlines()[0]) == (0, "run exp-a")
    status, out, err = cli("analyst", "runs", "show", "other")
    assert (status, out) == (EXIT_REFUSED, "")
    assert err == (
        "rolloutlog runs show: forbidden: this token holds the analyst role for other runs, "
        "not 'other'\n"
    )
    assert cli("trainer", "runs", "create", "exp-from-cli")[0] == 0
    status, _, err = cli("trainer", "runs", "create", "elsewhere")
    assert status == EXIT_REFUSED and ": forbidden: " in err
    assert client.get("/v1/runs/elsewhere", headers=bearer("admin")).status_code == 404
    status, _, err = cli("trainer", "runs", "delete", "other")
    assert status == EXIT_REFUSED and ": forbidden: " in err
    assert client.get("/v1/runs/other", headers=bearer("admin")).status_code == 200
    assert cli("trainer", "runs", "delete", "exp-from-cli")[0] == 0
    status, out, _ = cli("analyst", "episodes", "exp-b", "--json")
    assert status == 0 and '"ep"' in out
    assert cli("analyst", "episodes", "zzz-last")[0] == EXIT_REFUSED


def _run_labels(body: str) -> set[str]:
    return {
        sample.labels["run"]
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if "run" in sample.labels
    }


def test_metrics_need_a_token_and_show_a_scoped_one_its_runs_only(
    guarded: tuple[Server, httpx.Client],
) -> None:
    _, client = guarded
    anonymous = client.get("/metrics")
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "unauthorized"
    assert anonymous.headers["www-authenticate"] == "Bearer"
    assert client.get("/metrics", headers=bearer("participant")).status_code == 403
    full = client.get("/metrics", headers=bearer("analyst"))
    assert full.status_code == 200
    assert _run_labels(full.text) >= set(INSIDE + OUTSIDE)  # (and runs other tests made)
    for role in ("analyst", "trainer", "admin"):
        scoped = client.get("/metrics", headers=_as(SCOPED[role]))
        assert scoped.status_code == 200
        shown = _run_labels(scoped.text)
        assert shown >= set(INSIDE), role
        assert all(run.startswith("exp-") or run == "exact-run" for run in shown), shown
        for run in OUTSIDE:  # named nowhere, not only in no label
            assert not re.search(rf'"{re.escape(run)}"', scoped.text), (role, run)
        assert "rolloutlog_http_request_duration_seconds" in scoped.text  # the rest stays


def test_readyz_names_runs_only_to_a_token_that_reads_them(
    guarded: tuple[Server, httpx.Client],
) -> None:
    _, client = guarded
    anonymous = client.get("/readyz")
    assert anonymous.status_code == 200  # readiness itself stays public (load balancers)
    assert anonymous.json()["runs"] == {} and anonymous.json()["status"] == "ready"
    for run in INSIDE + OUTSIDE:
        assert f'"{run}"' not in anonymous.text
    assert client.get("/readyz", headers=_as("not-a-token-of-this-service")).json()["runs"] == {}
    assert set(client.get("/readyz", headers=bearer("analyst")).json()["runs"]) == set(
        INSIDE + OUTSIDE
    )
    assert set(client.get("/readyz", headers=_as(SCOPED["analyst"])).json()["runs"]) == set(INSIDE)


def test_without_metrics_auth_metrics_and_readyz_stay_open(tmp_path: Path) -> None:
    with scoped_server(tmp_path) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        _seed(client, ("exp-a", "other"))
        assert _run_labels(client.get("/metrics").text) == {"exp-a", "other"}
        assert set(client.get("/readyz").json()["runs"]) == {"exp-a", "other"}
