"""The demo's ``--fork``: the run is forked at its checkpoint and the fork's rollouts continue
beside the run's, in the same participant processes, under another policy version."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from rolloutlog.participants.sim.demo import main, run_demo

pytestmark = pytest.mark.slow


async def test_the_demo_forks_its_run_and_both_finish_right(tmp_path: Path) -> None:
    out = io.StringIO()
    result = await run_demo(
        24, concurrency=8, data_dir=tmp_path / "gym", fork_policy_version=2, out=out
    )
    assert result.ok, out.getvalue()
    assert result.fork is not None
    assert result.fork.rollouts > 0
    assert result.fork.right == result.fork.rollouts
    assert result.fork.continued + result.fork.restarted == result.fork.rollouts
    calls = [c for c in result.stats["policy"]["calls"] if c["delivered"]]
    assert {(c["run"], c["policy_version"]) for c in calls} == {("demo", 1), ("demo-fork", 2)}
    assert "fork demo-fork (policy version 2): " in out.getvalue()


def test_the_fork_flag_is_the_policy_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--fork POLICY_VERSION" in capsys.readouterr().out
