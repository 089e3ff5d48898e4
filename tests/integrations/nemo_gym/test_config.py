"""What needs no NeMo Gym: settings from a NeMo Gym config, the entrypoint's server class, the
ng_run shims, and the venv's key and Python."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from rolloutlog.integrations.nemo_gym import GymSettings
from rolloutlog.integrations.nemo_gym._config import server_dict, server_instances
from rolloutlog.integrations.nemo_gym._launcher import _entrypoint_class
from rolloutlog.integrations.nemo_gym._ng_run import SHIM, write_overlay
from rolloutlog.integrations.nemo_gym._venv import (
    _prune,
    find_python,
    rolloutlog_requirements,
    venv_path,
)
from rolloutlog.participants import HttpTransport

CONFIG = {
    "policy_base_url": "http://x/v1",
    "head_server": {"host": "127.0.0.1", "port": 11000},
    "rolloutlog": {"url": "http://svc:1", "run": "r1"},
    "counter": {
        "resources_servers": {
            "example_session_state_mgmt": {
                "entrypoint": "app.py",
                "domain": "agent",
                "rolloutlog": {"mode": "exported", "id": "counter-0"},
            }
        }
    },
    "agent": {"responses_api_agents": {"simple_agent": {"entrypoint": "app.py"}}},
    "not_a_server": {"resources_servers": {"x": {"no": "entrypoint"}}},
}


def test_settings_come_from_the_config_then_the_environment() -> None:
    assert server_instances(CONFIG) == {
        "counter": ("resources_servers", "example_session_state_mgmt"),
        "agent": ("responses_api_agents", "simple_agent"),
    }
    assert server_dict(CONFIG, "agent") == {"entrypoint": "app.py"}
    counter = GymSettings.from_config(CONFIG, "counter", env={"ROLLOUTLOG_TOKEN": "t"})
    assert counter is not None
    assert (counter.url, counter.run, counter.participant_id, counter.token) == (
        "http://svc:1",
        "r1",
        "counter-0",
        "t",
    )
    assert counter.kind == "resources_servers" and counter.options["mode"] == "exported"
    assert isinstance(counter.transport(), HttpTransport)
    bare = {k: v for k, v in CONFIG.items() if k != "rolloutlog"}
    assert GymSettings.from_config(bare, "agent", env={}) is None  # no run: nothing attached
    agent = GymSettings.from_config(bare, "agent", env={"ROLLOUTLOG_RUN": "r2"})
    assert agent is not None and (agent.run, agent.participant_id) == ("r2", "agent")


def test_the_server_class_is_the_one_the_entrypoint_runs(tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text(
        "class Helper: pass\nclass MyServer: pass\n"
        "if __name__ == '__main__':\n    MyServer.run_webserver()\n"
    )
    assert _entrypoint_class(app) == "MyServer"
    app.write_text("class MyServer: pass\n")
    with pytest.raises(ValueError, match="run_webserver"):
        _entrypoint_class(app)


def test_the_ng_run_overlay_shims_every_server(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    venv.mkdir()
    written = write_overlay(CONFIG, tmp_path / "gym", venv)
    assert written == [
        tmp_path / "gym" / "resources_servers" / "example_session_state_mgmt",
        tmp_path / "gym" / "responses_api_agents" / "simple_agent",
    ]
    for directory in written:
        assert (directory / "app.py").read_text() == SHIM
        assert (directory / "requirements.txt").exists()  # ng_run takes the directory first
        assert (directory / ".venv").resolve() == venv.resolve()
    assert write_overlay(CONFIG, tmp_path / "gym", venv) == written  # again: replaced


def test_the_venv_is_keyed_by_python_and_requirements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUTLOG_CACHE_DIR", str(tmp_path))
    root = tmp_path / "checkout"
    root.mkdir()
    pyproject = root / "pyproject.toml"
    pyproject.write_text(
        '[project]\ndependencies = ["orjson>=3"]\n'
        '[project.optional-dependencies]\nnemo-gym = ["nemo_gym>=0.4", "uvicorn"]\n'
    )
    assert rolloutlog_requirements(root) == ["orjson>=3", "uvicorn"]  # NeMo Gym: --no-deps
    first = venv_path(sys.executable, root)
    assert first.parent == tmp_path / "nemo-gym"
    assert first.name.startswith(f"py{sys.version_info[0]}.{sys.version_info[1]}-")
    assert venv_path(sys.executable, root) == first
    pyproject.write_text('[project]\ndependencies = ["orjson>=3.10"]\n')
    assert venv_path(sys.executable, root) != first


def test_python_below_3_12_is_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUTLOG_NEMO_GYM_PYTHON", sys.executable)
    expected = sys.executable if sys.version_info >= (3, 12) else None
    assert find_python() == expected
    monkeypatch.setenv("ROLLOUTLOG_NEMO_GYM_PYTHON", "/nonexistent/python3.12")
    assert find_python() is None


def test_the_cache_keeps_the_newest_venvs(tmp_path: Path) -> None:
    for age, name in enumerate(["py3.12-d", "py3.12-c", "py3.12-b", "py3.12-a"]):
        (tmp_path / name).mkdir()
        done = tmp_path / name / ".complete"
        done.write_text("{}")
        os.utime(done, (1000.0 - age, 1000.0 - age))
    (tmp_path / "py3.12-building").mkdir()  # no .complete: being built
    _prune(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "py3.12-b",
        "py3.12-building",
        "py3.12-c",
        "py3.12-d",
    ]
