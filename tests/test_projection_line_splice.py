"""``encode_line_pieces`` (``ProjectionLine.of``'s encoding): large opaque values spliced into
the line give the same bytes as orjson's plain encoding; in pieces they are not copied at all,
joined (``ProjectionLine.line``) they are copied once."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any, TypeVar
from unittest import mock

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutlog.core import ProjectionLine, _opaque
from rolloutlog.core._model import BoundaryView, EpisodeProjection, LedgerEntry, SessionView
from rolloutlog.core._opaque import (
    SPLICE_BYTES,
    Opaque,
    encode_line_pieces,
    encode_opaque,
    joined,
)

T = TypeVar("T")

#: Strings JSON must escape, or that look like JSON, or like the splice's mark.
TRICKY = ["", '"', "\\", "\x00", "\x00\x00", "\n\t", '{"a":', "]}", "é€😀", "\u2028", "a\x00b"]


def encode_line(value: Any) -> bytes:
    """The line ``ProjectionLine.line`` gives: its pieces joined."""
    return joined(encode_line_pieces(value))


def plain(value: Any) -> bytes:
    """The line as it was encoded before splicing: everything through orjson's buffer."""
    return orjson.dumps(value, default=encode_opaque) + b"\n"


def large(value: Any) -> Opaque:
    """``value`` as an opaque state of at least ``SPLICE_BYTES``."""
    raw = orjson.dumps({"pad": "p" * SPLICE_BYTES, "value": value})
    assert len(raw) >= SPLICE_BYTES
    return Opaque(raw)


texts = st.one_of(st.sampled_from(TRICKY), st.text(max_size=20))
json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    texts,
)
json_values = st.recursive(
    json_leaves,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)
opaques = json_values.map(lambda v: Opaque(orjson.dumps(v)))
#: Values holding opaque ones anywhere (keys tricky too), as ``to_json`` gives them.
with_opaques = st.recursive(
    st.one_of(json_leaves, opaques),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(texts, inner, max_size=5)),
    max_leaves=16,
)


@settings(max_examples=300, deadline=None)
@given(with_opaques, st.integers(0, 40))
def test_same_bytes_as_orjson_whatever_is_spliced(value: Any, splice_bytes: int) -> None:
    # A small threshold splices most opaque values of these small ones, 0 every one of them.
    with mock.patch.object(_opaque, "SPLICE_BYTES", splice_bytes):
        assert encode_line(value) == plain(value)


def projection(
    *,
    task: Opaque | None,
    boundaries: dict[str, Opaque | None],
    sessions: dict[str, Opaque | None],
    ledger: tuple[LedgerEntry, ...] = (),
) -> EpisodeProjection:
    return EpisodeProjection(
        episode="ep-\x00-1",
        attempt=2,
        status="live",
        cut=40,
        first_offset=0,
        task=task,
        task_digest="sha",
        deadline_s=None,
        boundaries={
            owner: BoundaryView("stage", None, state, 3, 7) for owner, state in boundaries.items()
        },
        sessions={
            sid: SessionView(sid, "resources", "res-0", "export", "none", state)
            for sid, state in sessions.items()
        },
        ledger=ledger,
        generation_cut=None,
        open_waits={},
        committed_through=7,
    )


ROW = LedgerEntry("c1", None, "f", "d", 1, 0, 3, "g", None, False, token_ids_json=b"[1,2,3]")

PROJECTIONS = {
    "no states": projection(task=None, boundaries={"environment": None}, sessions={}),
    "small states only (S1)": projection(
        task=Opaque(b'{"prompt":"hi"}'),
        boundaries={"environment": Opaque(b'{"turn":3}'), "agent-1": Opaque(b"[]")},
        sessions={"s1": Opaque(b'"\\u0000"')},
        ledger=(ROW,),
    ),
    "one large state (S2)": projection(
        task=Opaque(b'{"prompt":"hi"}'),
        boundaries={"environment": Opaque(b"{}")},
        sessions={"s1": large("state")},
    ),
    "large and small, tricky": projection(
        task=large(TRICKY),
        boundaries={"environment": Opaque(b'"\\""'), "agent-\x00": large({"\x00": "]}"})},
        sessions={"s1": large(None), "s2": Opaque(b"null"), "s3": None, "s4": large([1, "\\"])},
        ledger=(ROW, ROW),
    ),
    "the same large state twice": projection(
        task=None, boundaries={}, sessions={"s1": large(1), "s2": large(1)}
    ),
}


@pytest.mark.parametrize("name", PROJECTIONS)
def test_projection_lines_are_the_plain_encoding(name: str) -> None:
    value = PROJECTIONS[name]
    line = ProjectionLine.of(value).line
    assert line == plain(value.to_json())
    assert orjson.loads(line)["episode"] == value.episode


def test_a_nul_in_a_small_opaque_falls_back_to_the_plain_encoding() -> None:
    # Not JSON (its trusted constructor does not check), but its line must still be as before:
    # the NUL is no mark.
    value = {"bad": Opaque(b'"a\x00b"'), "state": large("x"), "after": Opaque(b"\x00")}
    assert encode_line(value) == plain(value)


def _with_peak(encode: Callable[[Any], T], value: Any) -> tuple[T, int]:
    """``encode(value)`` and the most memory it held at once (tracemalloc)."""
    tracemalloc.start()
    try:
        encoded = encode(value)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return encoded, peak


def test_a_large_state_is_copied_once() -> None:
    state = large("s" * (4 << 20))
    value = {"episode": "e", "sessions": {"s1": {"state": state}, "s2": {"state": None}}}
    line, peak = _with_peak(encode_line, value)
    assert line == plain(value)
    # The line itself, and nothing of its size besides (orjson's buffer, its bytes and the
    # newline's join held ~3 lines at once).
    assert peak < 1.1 * len(line)


def test_in_pieces_a_large_state_is_not_copied() -> None:
    state = large("s" * (4 << 20))
    view = Opaque(memoryview(b"  " + state.raw)[2:])  # as a projection composed from a record
    value = {"episode": "e", "sessions": {"s1": {"state": state}, "s2": {"state": view}}}
    pieces, peak = _with_peak(encode_line_pieces, value)
    assert b"".join(pieces) == plain(value)
    assert [piece for piece in pieces if len(piece) >= SPLICE_BYTES] == [state.raw, view.raw]
    assert pieces[1] is state.raw and pieces[3] is view.raw
    assert peak < 64 * 1024  # the small pieces only
    assert ProjectionLine.of(PROJECTIONS["large and small, tricky"]).size == len(
        plain(PROJECTIONS["large and small, tricky"].to_json())
    )
