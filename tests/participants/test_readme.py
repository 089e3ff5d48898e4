"""The README's participants example runs as written (inside an async function, with the values
it leaves to the reader defined) against a real server."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests._readme import python_example, run_against_server

pytestmark = pytest.mark.slow

PREAMBLE = """
import asyncio
import os
from rolloutlog.trainer import AsyncTrainerClient

URL, TOKEN = os.environ["ROLLOUTLOG_URL"], os.environ["ROLLOUTLOG_TOKEN"]
task, reward, result = {"prompt": "add 3"}, 1.0, {"answer": 3}
loop_state, tokens, digest, ctx = {"turn": 1}, list(range(600)), "req-1", "ctx-1"
turns, reply = ["hello"], "world"

class seed_reply:
    headers = {"x-ng-checkpoint-verify": "wait"}

async def main():
    async with AsyncTrainerClient(URL, token=TOKEN) as trainer:
        await trainer.create_run("run-1", partitions=4)
"""
EPILOGUE = """
    assert generation.chunks == 3 and episode.verify_mode == "wait"
    assert reply_headers["x-ng-checkpoint-verify"] == "replay"
    print("participants example ok")

asyncio.run(main())
"""


def participants_example() -> str:
    code = python_example("## Participants SDK").replace(
        '"http://127.0.0.1:8750", token="…"', "URL, token=TOKEN"
    )
    return PREAMBLE + textwrap.indent(code, "    ") + EPILOGUE


def test_the_readme_participants_example_runs(tmp_path: Path) -> None:
    done = run_against_server(tmp_path, participants_example())
    assert done.returncode == 0, done.stderr
    assert "participants example ok" in done.stdout
