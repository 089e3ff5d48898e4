"""The NeMo Gym venv of rolloutlog's tests and demo: Python >= 3.12, built on first use, cached.

NeMo Gym 0.4.0 needs Python >= 3.12 and its own dependencies (Ray among them), so its servers
run in a venv apart from rolloutlog's. ``ensure_venv()`` builds it once per machine under
``~/.cache/rolloutlog/nemo-gym/<key>`` (``ROLLOUTLOG_CACHE_DIR`` moves it), keyed by the Python
version and the pinned requirements (NeMo Gym's, and rolloutlog's own as ``pyproject.toml``
declares them), so later runs and CI on the machine reuse it and a change of any of them
builds a new one (the three newest are kept). The venv holds rolloutlog's dependencies, not rolloutlog: run the checkout's
code in it with ``PYTHONPATH`` (``gym_env()``), so a cached venv never runs stale code.

Python is found as ``ROLLOUTLOG_NEMO_GYM_PYTHON``, else pyenv's 3.12/3.13 versions, else
``python3.12``/``python3.13`` on ``PATH``; none: ``find_python()`` returns None.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = [
    "NEMO_GYM_REQUIREMENT",
    "RUNTIME_REQUIREMENTS",
    "ensure_venv",
    "find_python",
    "gym_env",
    "rolloutlog_requirements",
    "venv_path",
]

NEMO_GYM_REQUIREMENT = "nemo-gym==0.4.0"
#: What NeMo Gym 0.4.0's servers, its config parser and its rollout collection import (it is
#: installed with ``--no-deps``: its full dependency set adds mlflow, datasets, pyarrow, ...).
RUNTIME_REQUIREMENTS = (
    "ray==2.60.0",
    "wandb",
    "hydra-core",
    "omegaconf",
    "fastapi",
    "uvicorn",
    "uvloop",
    "aiohttp>=3.14.1",
    "openai<=2.7.2",
    "anthropic<=0.109.2",
    "orjson",
    "requests",
    "itsdangerous",
    "pydantic",
    "rich",
    "devtools",
    "tqdm",
    "psutil",
    "pandas",
    "gprof2dot",
    "pydot",
    "yappi",
    "python-multipart",
)
#: Imported once the venv is built: a missing dependency fails the build, not a test.
CHECK_IMPORTS = (
    "nemo_gym.cli.env",
    "nemo_gym.rollout_collection",
    "resources_servers.example_session_state_mgmt.app",
    "resources_servers.example_multi_step.app",
    "responses_api_agents.simple_agent.app",
    "responses_api_models.vllm_model.app",
)
#: Bumped when the way the venv is built changes (it is part of the key).
BUILD_VERSION = 1
MIN_PYTHON = (3, 12)
#: Built venvs kept in the cache (the newest).
KEEP = 3
ROOT = Path(__file__).resolve().parents[3]


def _version(python: str) -> tuple[int, ...] | None:
    try:
        done = subprocess.run(
            [python, "-c", "import platform; print(platform.python_version())"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return tuple(int(part) for part in done.stdout.strip().split(".")[:3])


def _candidates() -> Iterator[str]:
    explicit = os.environ.get("ROLLOUTLOG_NEMO_GYM_PYTHON")
    if explicit:
        yield explicit
        return
    pyenv = shutil.which("pyenv")
    if pyenv is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            bare = subprocess.run(
                [pyenv, "versions", "--bare"], capture_output=True, text=True, timeout=30
            ).stdout.split()
            for version in sorted(v for v in bare if v.startswith(("3.12.", "3.13."))):
                env = {**os.environ, "PYENV_VERSION": version}
                found = subprocess.run(
                    [pyenv, "which", "python" + version.rsplit(".", 1)[0]],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    env=env,
                ).stdout.strip()
                if found:
                    yield found
    for name in ("python3.12", "python3.13"):
        path = shutil.which(name)
        if path is not None:
            yield path


def find_python() -> str | None:
    """A Python >= 3.12 interpreter, or None."""
    for candidate in _candidates():
        version = _version(candidate)
        if version is not None and version[:2] >= MIN_PYTHON:
            return candidate
    return None


def rolloutlog_requirements(root: Path = ROOT) -> list[str]:
    """rolloutlog's own requirements in a Gym venv: its base and its ``nemo-gym`` extra."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extra = project.get("optional-dependencies", {}).get("nemo-gym", [])
    # NeMo Gym itself is installed without its dependencies (above): naming it again would
    # make pip install them all
    return [r for r in (*project["dependencies"], *extra) if not _names_nemo_gym(r)]


def _names_nemo_gym(requirement: str) -> bool:
    name = requirement.split(";")[0].split("[")[0]
    for mark in "<>=!~ ":
        name = name.split(mark)[0]
    return name.strip().lower().replace("_", "-") == "nemo-gym"


def _cache_dir() -> Path:
    explicit = os.environ.get("ROLLOUTLOG_CACHE_DIR")
    base = Path(explicit) if explicit else Path.home() / ".cache" / "rolloutlog"
    return base / "nemo-gym"


def venv_path(python: str, root: Path = ROOT) -> Path:
    """Where the venv for ``python`` and the current requirements lives (built or not)."""
    version = _version(python)
    if version is None:
        raise RuntimeError(f"{python} does not run")
    keyed = {
        "python": ".".join(map(str, version)),
        "nemo_gym": NEMO_GYM_REQUIREMENT,
        "runtime": list(RUNTIME_REQUIREMENTS),
        "rolloutlog": rolloutlog_requirements(root),
        "build": BUILD_VERSION,
    }
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
    return _cache_dir() / f"py{version[0]}.{version[1]}-{key}"


def _pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args], check=True)


def ensure_venv(python: str | None = None, root: Path = ROOT, *, quiet: bool = False) -> Path:
    """The venv's directory, built first if it is not there (one builder at a time; a build
    killed half way is started again)."""
    python = python or find_python()
    if python is None:
        raise RuntimeError("no Python >= 3.12 found (pyenv, PATH, ROLLOUTLOG_NEMO_GYM_PYTHON)")
    venv = venv_path(python, root)
    done = venv / ".complete"
    if done.exists():
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():  # built while this one waited
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        began = time.monotonic()
        if not quiet:
            print(f"building the NeMo Gym venv {venv} (once per machine) ...", file=sys.stderr)
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        _pip(venv, "--no-deps", NEMO_GYM_REQUIREMENT)
        _pip(venv, *RUNTIME_REQUIREMENTS, *rolloutlog_requirements(root))
        check = "; ".join(f"import {module}" for module in CHECK_IMPORTS)
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", check], check=True, env=gym_env(venv, root)
        )
        done.write_text(json.dumps({"built_s": round(time.monotonic() - began, 1)}))
        if not quiet:
            print(f"built in {time.monotonic() - began:.0f} s", file=sys.stderr)
    _prune(venv.parent, KEEP)
    return venv


def _prune(cache: Path, keep: int) -> None:
    """Remove all but the ``keep`` most recently built venvs (checkouts of other revisions on
    the machine may still use those); one being built (no ``.complete``) is left alone."""
    built = sorted(
        (p for p in cache.iterdir() if (p / ".complete").exists()),
        key=lambda p: (p / ".complete").stat().st_mtime,
        reverse=True,
    )
    for old in built[keep:]:
        shutil.rmtree(old, ignore_errors=True)
        (cache / f"{old.name}.lock").unlink(missing_ok=True)


def gym_env(venv: Path, root: Path = ROOT, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment to run the checkout's rolloutlog in the venv: the checkout first on
    ``PYTHONPATH``, and no telemetry, W&B or hub downloads."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join((str(venv / "bin"), env.get("PATH", "")))
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("WANDB_MODE", "disabled")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env
