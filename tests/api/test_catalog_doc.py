"""docs/catalog.md's Python snippet, run as written: against a real catalog it prints the latest
manifest; without one it says so and leaves no empty database behind."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests import factories as f
from tests._services import ROOT
from tests.api.conftest import open_api, settings_for


def _snippet() -> str:
    text = (ROOT / "docs" / "catalog.md").read_text()
    section = text[text.index("\n## From Python") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


def _run(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _snippet()], cwd=cwd, capture_output=True, text=True, timeout=60
    )


async def test_the_snippet_reads_the_catalog_and_never_creates_one(tmp_path: Path) -> None:
    missing = _run(tmp_path)
    assert missing.returncode != 0
    assert "no catalog at rolloutlog-data/catalog.sqlite3" in missing.stderr
    assert not (tmp_path / "rolloutlog-data").exists()

    async with open_api(settings_for(tmp_path / "rolloutlog-data")) as api:
        api.run = "run-1"
        await api.create_run("run-1")
        await api.register()
        await api.take_over()
        await api.append(f.started("ep-1"), f.boundary("ep-1", "seed", {"turn": 1}))
        await api.checkpoint()
    found = _run(tmp_path)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == ["ep-1", "continue", "ep-1"]
