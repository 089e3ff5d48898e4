"""How the CLI prints: aligned tables for people, JSON Lines for scripts, a spinner on a TTY.

``--json`` follows one convention everywhere: JSON Lines (NDJSON), one compact JSON object per
line. A listing prints one line per item (nothing at all when it is empty), any other command
one line; so ``head -1``, ``wc -l`` and ``jq -c`` work on every command's output alike.
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, TextIO

import orjson

__all__ = [
    "Column",
    "Progress",
    "fields",
    "json_line",
    "json_lines",
    "listing",
    "stdout",
    "table",
    "tally",
    "when",
]

Column = tuple[str, Callable[[Mapping[str, Any]], Any]]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def table(rows: Iterable[Mapping[str, Any]], columns: Sequence[Column], out: TextIO) -> int:
    """Print rows as an aligned table under a header (nothing when there are no rows);
    returns how many rows it printed."""
    cells = [[_cell(get(row)) for _, get in columns] for row in rows]
    if not cells:
        return 0
    headers = [header for header, _ in columns]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(), file=out)
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(), file=out)
    return len(cells)


def fields(pairs: Iterable[tuple[str, Any]], out: TextIO) -> None:
    """Print ``name  value`` lines, names aligned (one object shown to a person)."""
    rows = [(name, _cell(value)) for name, value in pairs]
    width = max((len(name) for name, _ in rows), default=0)
    for name, value in rows:
        print(f"  {name.ljust(width)}  {value}", file=out)


def tally(counts: Mapping[str, Any]) -> str:
    """Counts as ``key=value`` pairs: ``continue=3 restart=1``."""
    return " ".join(f"{key}={value}" for key, value in counts.items())


def json_line(value: Any, out: TextIO) -> None:
    out.write(orjson.dumps(value).decode() + "\n")


def json_lines(values: Iterable[Any], out: TextIO) -> None:
    for value in values:
        json_line(value, out)


def stdout() -> TextIO:
    """``sys.stdout``, looked up at each call: tests and pipes may replace it."""
    return sys.stdout


def listing(
    rows: Iterable[Mapping[str, Any]], columns: Sequence[Column], as_json: bool, empty: str
) -> None:
    """A listing's output: one JSON line per row, or a table of them, or ``empty`` (a person's
    line saying there is none; JSON Lines print nothing then)."""
    out = stdout()
    if as_json:
        json_lines(rows, out)
    elif not table(rows, columns, out):
        print(empty, file=out)


def when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


class Progress:
    """A spinner with the elapsed time on stderr while a long call runs (TTYs only)."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _spin(self) -> None:
        frames = "|/-\\"
        index = 0
        while not self._stop.wait(0.1):
            elapsed = time.monotonic() - self.started
            sys.stderr.write(f"\r{frames[index % 4]} {self.label} {elapsed:5.1f} s")
            sys.stderr.flush()
            index += 1

    def __enter__(self) -> Progress:
        if self.enabled:
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
