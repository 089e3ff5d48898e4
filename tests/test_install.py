"""What ``pip install rolloutlog`` installs: the participant SDK, the trainer client, the event
log and the CLI's client commands, with their own dependencies only; the service is the
``server`` extra, and ``rolloutlog serve`` without it says so in one line.

Checked without building a venv: the base install's distributions are the closure of the base
requirements in the installed metadata, and a subprocess refuses every module whose file
belongs to another distribution (a meta-path finder), as if it were not installed.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from rolloutlog.api.cli._main import EXIT_UNREACHABLE, EXIT_USAGE

#: What a participant or a trainer imports from the base install.
SDK_MODULES = (
    "rolloutlog.participants",
    "rolloutlog.trainer",
    "rolloutlog.log",
    "rolloutlog.log.embedded",
    "rolloutlog.log.kafka",
    "rolloutlog.api.cli",
)
#: Some of the service's packages: none of them may come with the base install.
SERVICE_PACKAGES = {"fastapi", "starlette", "uvicorn", "sqlalchemy", "asyncpg", "alembic"}

# Run in a subprocess: argv[1] is JSON, the base install's distributions and the modules to
# import; argv[2:] the command line given to ``rolloutlog`` then.
_CHILD = """
import importlib, importlib.abc, importlib.machinery, importlib.metadata as md, json, os, re, sys

given = json.loads(sys.argv[1])
base = set(given["base"])
refused = set()
for dist in md.distributions():
    name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
    if name not in base:
        refused.update(os.path.normpath(dist.locate_file(f)) for f in dist.files or ())


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.origin and os.path.normpath(spec.origin) in refused:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
for module in given["modules"]:
    importlib.import_module(module)
from rolloutlog.api.cli import main

sys.exit(main(sys.argv[2:]))
"""


def _closure(name: str, extras: frozenset[str] = frozenset()) -> set[str]:
    """The distributions ``name`` (with ``extras``) installs: its requirements, recursively,
    read from the installed metadata, markers evaluated here."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(canonicalize_name(name), extras)]
    while todo:
        item = todo.pop()
        if item in seen:
            continue
        seen.add(item)
        for line in md.requires(item[0]) or ():
            req = Requirement(line)
            wanted = item[1] or {""}
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted):
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return {name for name, _ in seen}


def _requirements(extra: str) -> list[Requirement]:
    """The requirements the ``extra`` extra adds (``""``: the base install's)."""
    found = [Requirement(line) for line in md.requires("rolloutlog") or ()]
    if not extra:
        return [r for r in found if r.marker is None or r.marker.evaluate({"extra": ""})]
    return [
        r
        for r in found
        if r.marker is not None
        and r.marker.evaluate({"extra": extra})
        and not r.marker.evaluate({"extra": ""})
    ]


def _base_only(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    given = {"base": sorted(_closure("rolloutlog")), "modules": SDK_MODULES}
    return subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(given), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def test_the_base_install_leaves_the_service_to_its_extra() -> None:
    base = _closure("rolloutlog")
    assert not base & SERVICE_PACKAGES, base & SERVICE_PACKAGES
    server = {canonicalize_name(r.name) for r in _requirements("server")}
    assert SERVICE_PACKAGES - {"starlette"} <= server
    assert not server & {canonicalize_name(r.name) for r in _requirements("")}
    # The tests and the benchmarks run the service.
    for extra in ("test", "bench"):
        assert "server" in {
            e for r in _requirements(extra) if r.name == "rolloutlog" for e in r.extras
        }
    assert "nemo-gym" in (md.metadata("rolloutlog").get_all("Provides-Extra") or [])


def test_the_sdk_the_trainer_client_and_the_cli_clients_need_only_the_base_install(
    tmp_path: Path,
) -> None:
    done = _base_only("runs", "list", "--url", "http://127.0.0.1:9", cwd=tmp_path)
    assert done.returncode == EXIT_UNREACHABLE, done.stderr
    assert done.stderr.startswith("rolloutlog runs list: unreachable: "), done.stderr


def test_serve_without_the_server_extra_names_it_in_one_line(tmp_path: Path) -> None:
    done = _base_only("serve", "--data-dir", str(tmp_path / "data"), cwd=tmp_path)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("rolloutlog serve: cannot start: invalid_configuration: the service ")
    assert line.endswith(" is not installed): pip install 'rolloutlog[server]' (exit 2)"), line
    assert not (tmp_path / "data").exists()
