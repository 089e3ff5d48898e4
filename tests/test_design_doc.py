"""docs/design.md §9 ("The code as built") stays true: every module it names exists, in the room
it is listed under, at about the size it says, and every sizeable module is named there."""

from __future__ import annotations

import re
from pathlib import Path

import rolloutlog

ROOT = Path(rolloutlog.__file__).resolve().parent
DESIGN = ROOT.parent / "docs" / "design.md"

#: A module named with its size: "`_events.py` (260)", "`embedded.py` (780)".
_ENTRY = re.compile(r"`((?:[\w/]+/)?\w+\.py)` \((\d+)[):]")
#: A room's heading: "**`core/`**", "**`log/`** (2.2k)"; "**Ground floor** (`rolloutlog/`)" is
#: the package's own top level (room "").
_ROOM = re.compile(r"^\*\*(?:`(\w+)/`|Ground floor)\*\*", re.MULTILINE)
#: Modules this long must be named (smaller ones may be, and are checked when they are).
_NAMED_FROM_LINES = 200


def _rooms() -> dict[str, list[tuple[str, int]]]:
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("### The rooms", 1)[1].split("### Which room imports which", 1)[0]
    rooms: dict[str, list[tuple[str, int]]] = {}
    headings = list(_ROOM.finditer(section))
    for heading, following in zip(headings, [*headings[1:], None], strict=True):
        body = section[heading.end() : following.start() if following else None]
        rooms[heading.group(1) or ""] = [(name, int(size)) for name, size in _ENTRY.findall(body)]
    return rooms


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_every_module_named_exists_at_about_its_size() -> None:
    wrong = []
    for room, entries in _rooms().items():
        for name, size in entries:
            path = ROOT / room / name
            if not path.exists():
                wrong.append(f"{room}/{name}: no such module")
                continue
            actual = _lines(path)
            if abs(actual - size) > max(40, actual // 4):
                wrong.append(f"{room}/{name}: {actual} lines, the doc says {size}")
    assert wrong == []


def _modules(room: str) -> list[Path]:
    """A room's modules, its sub-packages' too (``sim/``, ``cli/``), migrations aside (frozen);
    the ground floor's are its own files only."""
    if not room:
        return sorted(ROOT.glob("*.py"))
    return sorted(p for p in (ROOT / room).rglob("*.py") if "migrations" not in p.parts)


def test_every_sizeable_module_is_named_in_its_room() -> None:
    named = {
        f"{room}/{name}" if room else name
        for room, entries in _rooms().items()
        for name, _ in entries
    }
    missing = []
    for room in _rooms():
        for path in _modules(room):
            relative = path.relative_to(ROOT).as_posix()
            if _lines(path) >= _NAMED_FROM_LINES and relative not in named:
                missing.append(f"{relative} ({_lines(path)} lines)")
    assert missing == []


def test_every_package_is_a_room() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - set(_rooms()) == set()


#: A room's size in its heading: "**`log/`** (4.1k", "**`catalog/`** (6.6k, of which …".
_ROOM_SIZE = re.compile(r"^\*\*`(\w+)/`\*\* \((?:about )?([\d.]+)k", re.MULTILINE)
#: The section's opening figure: "About 39,600 lines of Python under `rolloutlog/`".
_TOTAL = re.compile(r"About ([\d,]+) lines of Python under `rolloutlog/`")


def test_the_room_sizes_and_the_total_are_about_right() -> None:
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("## 9. The code as built", 1)[1].split("### Which room imports which", 1)[
        0
    ]
    wrong = []
    for room, size in _ROOM_SIZE.findall(section):
        actual = sum(_lines(p) for p in (ROOT / room).rglob("*.py"))
        if abs(actual - float(size) * 1000) > actual * 0.15:
            wrong.append(f"{room}/: {actual} lines, the doc says {size}k")
    total = _TOTAL.search(section)
    assert total is not None
    actual = sum(_lines(p) for p in ROOT.rglob("*.py"))
    stated = int(total.group(1).replace(",", ""))
    if abs(actual - stated) > actual * 0.1:
        wrong.append(f"rolloutlog/: {actual} lines, the doc says about {stated}")
    assert wrong == []
