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


def test_every_sizeable_module_is_named_in_its_room() -> None:
    named = {
        f"{room}/{name}" if room else name
        for room, entries in _rooms().items()
        for name, _ in entries
    }
    missing = []
    for room in _rooms():
        for path in sorted((ROOT / room).glob("*.py")):
            relative = f"{room}/{path.name}" if room else path.name
            if _lines(path) >= _NAMED_FROM_LINES and relative not in named:
                missing.append(f"{relative} ({_lines(path)} lines)")
    assert missing == []
