"""What differs between the catalog's databases is decided inside the backend modules only:
the shared SQL never asks which database it runs on."""

from __future__ import annotations

import ast
from pathlib import Path

import rolloutlog.catalog

CATALOG = Path(rolloutlog.catalog.__file__).resolve().parent
#: The modules that may know which database they speak to.
BACKENDS = {"_backend.py", "_sqlite.py", "_postgres.py", "_tls.py", "_registry.py"}
#: Names of the databases as a branch would compare them.
DATABASES = {"sqlite", "postgresql", "postgres"}


def _branches(path: Path) -> list[str]:
    """Where ``path`` asks for the dialect, or compares a value with a database's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr == "dialect":
            found.append(f"{path.name}:{node.lineno}: .dialect")
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Constant) and side.value in DATABASES:
                    found.append(f"{path.name}:{node.lineno}: compares with {side.value!r}")
    return found


def test_no_shared_module_branches_on_the_database() -> None:
    shared = [p for p in sorted(CATALOG.glob("*.py")) if p.name not in BACKENDS]
    assert len(shared) > 10  # the catalog's modules were found
    assert [branch for path in shared for branch in _branches(path)] == []


def test_the_check_finds_a_branch(tmp_path: Path) -> None:
    branching = tmp_path / "_example.py"
    branching.write_text(
        "async def now(conn, clock):\n"
        "    if conn.dialect.name == 'postgresql':\n"
        "        return 0.0\n"
        "    return clock()\n"
    )
    assert _branches(branching) == [
        "_example.py:2: compares with 'postgresql'",
        "_example.py:2: .dialect",
    ]
