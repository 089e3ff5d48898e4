"""``NdjsonSplitter``: the SDK's and the trainer client's NDJSON line cutter, whatever the chunking."""

from __future__ import annotations

import orjson
from hypothesis import given
from hypothesis import strategies as st

from rolloutlog.wire import NdjsonSplitter

values = st.lists(
    st.recursive(
        st.none() | st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.text(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
        max_leaves=20,
    ),
    max_size=20,
)


@given(values, st.lists(st.integers(min_value=0, max_value=200), max_size=30), st.booleans())
def test_lines_survive_any_chunking(
    items: list[object], cuts: list[int], trailing_newline: bool
) -> None:
    body = b"\n".join(orjson.dumps(v) for v in items) + (b"\n" if trailing_newline else b"")
    body = body.replace(b"\n", b"\n  \n", 1)  # a blank line is skipped
    splitter = NdjsonSplitter()
    lines: list[bytes | memoryview] = []
    position = 0
    for cut in sorted(cuts):
        lines += splitter.feed(body[position:cut])
        position = max(position, cut)
    lines += splitter.feed(body[position:])
    lines += splitter.end()
    assert [orjson.loads(line) for line in lines] == items
