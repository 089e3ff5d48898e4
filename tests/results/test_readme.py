"""The README's trainer example (results, acknowledgement, resume) runs as written against a
real server, on a run where one episode finished after the checkpoint and its reply was lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._readme import python_example, run_against_server

pytestmark = pytest.mark.slow

SETUP = """
import os

import httpx

from rolloutlog.trainer import TrainerClient
from tests import factories as f
from tests.api.conftest import wire

url = os.environ["ROLLOUTLOG_URL"] + "/v1/runs/run-1"
headers = {"Authorization": "Bearer " + os.environ["ROLLOUTLOG_TOKEN"]}
with TrainerClient() as client:
    client.create_run("run-1", partitions=4)
    client.take_over("run-1")
    httpx.post(
        url + "/participants", json={"id": "env-0", "kind": "environment"}, headers=headers
    ).raise_for_status()
    started = [f.started(e) for e in ("r1", "r2")] + [f.boundary(e) for e in ("r1", "r2")]
    httpx.post(url + "/events", json=wire(*started), headers=headers).raise_for_status()
    client.checkpoint("run-1")
    finished = wire(f.finished("r2", 1.0, {"answer": 42}))
    httpx.post(url + "/events", json=finished, headers=headers).raise_for_status()
"""


def test_the_readme_trainer_example_runs(tmp_path: Path) -> None:
    example = python_example("## Trainers: results, acknowledgements, resuming")
    done = run_against_server(tmp_path, SETUP + example)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "result r2 1.0 {'answer': 42}",
        "dispatch r1 as r1-a1 continue",
        "unacknowledged 0",
    ]
