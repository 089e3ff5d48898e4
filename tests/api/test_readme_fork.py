"""The README's fork example runs as written against a real server holding a live run-1."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._readme import python_example, run_against_server

pytestmark = pytest.mark.slow

#: run-1 as the example expects it: three live episodes and a committed checkpoint.
SETUP = """
import os
import httpx
from tests import factories as f
from tests.api.conftest import wire
headers = {"Authorization": "Bearer " + os.environ["ROLLOUTLOG_TOKEN"]}
with httpx.Client(base_url=os.environ["ROLLOUTLOG_URL"], headers=headers) as http:
    def ok(reply):
        assert reply.status_code < 300, reply.text
        return reply.json()
    ok(http.post("/v1/runs", json={"run": "run-1", "partitions": 4}))
    ok(http.post("/v1/runs/run-1/participants", json={"id": "env-0", "kind": "environment"}))
    epoch = ok(http.post("/v1/runs/run-1/controller"))["controller_epoch"]
    events = [e for r in ("r1", "r2", "r3") for e in (f.started(r), f.boundary(r, "seed", {}))]
    ok(http.post("/v1/runs/run-1/events", json=wire(*events)))
    ok(http.post("/v1/runs/run-1/checkpoints", json={"controller_epoch": epoch}))
"""


def test_the_readme_fork_example_runs(tmp_path: Path) -> None:
    done = run_against_server(tmp_path, SETUP + python_example("## Fork a run\n"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "forked from run-1 checkpoint 1"
    assert sorted(lines[1:3]) == [
        "dispatch r1 as r1-a1 continue",
        "dispatch r2 as r2-a1 continue",
    ]
    assert lines[3] == "forks of run-1: ['run-1-b']"
