"""``make demo-nemo-gym`` at a small scale (its module, as the target runs it): real NeMo Gym
0.4.0 servers crashed mid-flight and resumed, every row right, ``make demo``'s report."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from rolloutlog.integrations.nemo_gym.demo import run_demo
from tests.integrations.nemo_gym._gym import gym_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


async def test_the_nemo_gym_demo_resumes_every_row_with_its_reward(tmp_path: Path) -> None:
    gym_python()  # the venv (the test is unavailable without it)
    out = io.StringIO()
    report = await run_demo(12, concurrency=4, data_dir=tmp_path, out=out)
    text = out.getvalue()
    assert report.ok, text
    assert report.finished == report.right == report.rollouts == 12
    assert not report.lost and not report.failed and not report.wrong, text
    # the checkpoint was mid-flight: rows continued from their agents' boundaries
    assert report.continued >= 1 and sum(report.resumed_at.values()) == report.continued, text
    assert "rolloutlog demo report (NeMo Gym 0.4.0)" in text and text.rstrip().endswith("OK")
