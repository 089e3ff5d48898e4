"""The README's service example runs as written against a real server."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._readme import python_example, run_against_server

pytestmark = pytest.mark.slow


def test_the_readme_service_example_runs(tmp_path: Path) -> None:
    done = run_against_server(tmp_path, python_example("## Service\n"))
    assert done.returncode == 0, done.stderr
    assert "checkpoint 1 committed" in done.stdout
