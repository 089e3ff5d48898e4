"""``make demo-nemo-gym`` at a small scale (its module, as the target runs it): real NeMo Gym
0.4.0 servers crashed mid-flight and resumed, every row right, ``make demo``'s report."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.integrations.nemo_gym.demo import run_demo
from rolloutlog.participants.sim.demo import DemoReport
from tests.integrations.nemo_gym._gym import gym_python


@pytest.mark.slow
@pytest.mark.timeout(400)
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


def test_a_wrong_reward_or_a_lost_row_fails_the_report() -> None:
    figures: dict[str, Any] = dict(
        rollouts=3,
        finished=3,
        continued=1,
        restarted=0,
        resumed_at={"tool_round": 1},
        cut_calls=0,
        cut_tokens=0,
        right=3,
        recovered=0,
        lost=[],
        failed=[],
        wrong=[],
        checkpoint_s=0.01,
        checkpoint_service_ms={"total": 5.0},
        restore_s=0.02,
        restore_service_ms={"total": 7.0},
        participants_restart_s=1.0,
        total_s=9.0,
    )
    assert DemoReport(**figures).ok
    assert DemoReport(**figures).lines()[-1] == "  OK"
    wrong = DemoReport(**{**figures, "right": 2, "wrong": ["t1-r0"]})
    lost = DemoReport(**{**figures, "finished": 2, "right": 2, "lost": ["t2-r0"]})
    for report in (wrong, lost):
        assert not report.ok
        assert report.lines()[-1].startswith("  FAILED")
