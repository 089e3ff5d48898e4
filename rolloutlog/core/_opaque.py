"""Opaque JSON payloads (``task``, ``state``, ``result``): checked once, then carried as bytes."""

from __future__ import annotations

import mmap
from typing import Any

import orjson
from pydantic import GetCoreSchemaHandler
from pydantic_core import PydanticCustomError, core_schema


class Opaque:
    """A JSON value kept as its encoded bytes; never deep-validated, never re-encoded.

    Build one from a Python value (``Opaque.of(obj)``, encoded once) or from JSON bytes
    (``Opaque.from_json(raw)``, parsed once to check them). ``value()`` decodes on demand.
    A projection composed from log records holds each large one as a view of its record
    (``compose_projection``), which its line then carries as it is (``encode_line_pieces``).
    """

    __slots__ = ("raw",)

    def __init__(self, raw: bytes | memoryview) -> None:
        # Trusted constructor: ``raw`` must already be one valid JSON value.
        self.raw = raw

    @classmethod
    def of(cls, value: Any) -> Opaque:
        """Encode a Python value (the one check: orjson refuses what JSON cannot hold)."""
        if isinstance(value, Opaque):
            return value
        try:
            return cls(orjson.dumps(value))
        except TypeError as e:
            raise ValueError(f"not JSON-serializable: {e}") from e

    @classmethod
    def from_json(cls, raw: bytes | bytearray | memoryview | str) -> Opaque:
        """Check that ``raw`` holds one JSON value and keep its bytes as they are."""
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        try:
            orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from e
        return cls(data)

    def value(self) -> Any:
        """The decoded JSON value (a fresh decode on every call)."""
        return orjson.loads(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.raw == self.raw

    def __hash__(self) -> int:
        return hash(self.raw)

    def __repr__(self) -> str:
        head = bytes(self.raw[:40])
        return f"Opaque({head!r}{'...' if len(self.raw) > 40 else ''}, {len(self.raw)} bytes)"

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: type[Any], handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(_validate_opaque)


def _validate_opaque(value: Any) -> Opaque:
    if isinstance(value, Opaque):
        return value
    try:
        return Opaque.of(value)
    except ValueError as e:
        raise PydanticCustomError("opaque_json", "{reason}", {"reason": str(e)}) from e


def encode_opaque(value: Any) -> Any:
    """orjson's ``default`` for values holding ``Opaque``: its bytes go out as they are."""
    if isinstance(value, Opaque):
        raw = value.raw
        return orjson.Fragment(raw if isinstance(raw, bytes) else bytes(raw))
    raise TypeError(f"cannot encode {type(value).__name__}")


#: ``Opaque`` values at least this large are pieces of their own in ``encode_line_pieces``'s
#: line, not encoded.
SPLICE_BYTES = 64 * 1024
#: Where ``encode_line_pieces`` cuts the line for one: orjson escapes a NUL in every string it
#: writes, and valid JSON holds none, so a raw one in its output is a mark.
_MARK = b"\x00"
_MARK_FRAGMENT = orjson.Fragment(_MARK)


#: A line as ``encode_line_pieces`` gives it: bytes to be written one after another.
LinePieces = tuple[bytes | memoryview, ...]


def joined(pieces: LinePieces) -> bytes:
    """A line's pieces as one ``bytes`` (the piece itself when it is the only one)."""
    first = pieces[0]
    if len(pieces) == 1 and isinstance(first, bytes):
        return first
    return b"".join(pieces)


def mapped(piece: bytes | memoryview) -> bool:
    """Is ``piece`` a view of a file's mapping (a large state read in place, or kept in a file
    by a prepare): bytes the page cache holds, not the heap?"""
    return isinstance(piece, memoryview) and isinstance(piece.obj, mmap.mmap)


def encode_line_pieces(value: Any) -> LinePieces:
    """``value`` as JSON ending with a newline (an NDJSON line), its ``Opaque`` values raw as
    ``encode_opaque`` writes them, in pieces: joined (``joined``), the same bytes as
    ``orjson.dumps(value, default=encode_opaque) + b"\\n"``. One piece, but for each ``Opaque``
    of ``SPLICE_BYTES`` or more, whose raw bytes are a piece of their own, neither copied nor
    encoded. An S2 line holds a
    350 KB state: orjson would copy it into its growing buffer, then into its bytes; joining
    the pieces would copy it again, into fresh memory; as a piece it goes from the log's record
    to the response as it is. The large values are encoded as marks, and the line cut at them.
    The newline is joined rather than ``OPT_APPEND_NEWLINE``'d: orjson's own buffer is not
    shrunk to fit (an S1 line of 5.4 KB held 16 KB), the joined copy is."""
    large: list[bytes | memoryview] = []

    def default(item: Any) -> Any:
        if isinstance(item, Opaque) and len(item.raw) >= SPLICE_BYTES:
            large.append(item.raw)
            return _MARK_FRAGMENT
        return encode_opaque(item)

    encoded = orjson.dumps(value, default=default)
    if not large:
        return (encoded + b"\n",)
    pieces = encoded.split(_MARK)
    if len(pieces) != len(large) + 1:  # a NUL in a small one (not JSON): the plain copies
        return (orjson.dumps(value, default=encode_opaque) + b"\n",)
    out: list[bytes | memoryview] = [pieces[0]]
    for raw, piece in zip(large, pieces[1:], strict=True):
        out += (raw, piece)
    out[-1] = pieces[-1] + b"\n"
    return tuple(out)
