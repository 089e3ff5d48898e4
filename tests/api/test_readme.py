"""The README's service example runs as written against a real server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._services import ROOT
from tests.api.conftest import TOKENS
from tests.api.test_e2e import Server

pytestmark = pytest.mark.slow


def service_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("\n## Service\n") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


def test_the_readme_service_example_runs(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    server = Server(tmp_path / "data", tokens)
    server.start()
    try:
        env = {**os.environ, "ROLLOUTLOG_URL": server.url, "ROLLOUTLOG_TOKEN": TOKENS["admin"]}
        done = subprocess.run(
            [sys.executable, "-c", service_example()],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "checkpoint 1 committed" in done.stdout
    finally:
        assert server.stop() == 0
