"""Running the README's Python examples as written, against a real server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests._services import ROOT
from tests.api.conftest import TOKENS
from tests.api.test_e2e import Server


def python_example(heading: str) -> str:
    """The first ```python block after the README heading ``heading``."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index(f"\n{heading}") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, f"no python example under {heading!r}"
    return match.group(1)


def run_against_server(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with ``ROLLOUTLOG_URL``/``ROLLOUTLOG_TOKEN`` (admin)
    pointing at a real server started for it; the server must stop cleanly afterwards."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    server = Server(tmp_path / "data", tokens)
    server.start()
    try:
        env = {**os.environ, "ROLLOUTLOG_URL": server.url, "ROLLOUTLOG_TOKEN": TOKENS["admin"]}
        return subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        assert server.stop() == 0
