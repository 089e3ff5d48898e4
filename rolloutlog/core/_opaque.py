"""Opaque JSON payloads (``task``, ``state``, ``result``): checked once, then carried as bytes."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import GetCoreSchemaHandler
from pydantic_core import PydanticCustomError, core_schema


class Opaque:
    """A JSON value kept as its encoded bytes; never deep-validated, never re-encoded.

    Build one from a Python value (``Opaque.of(obj)``, encoded once) or from JSON bytes
    (``Opaque.from_json(raw)``, parsed once to check them). ``value()`` decodes on demand.
    """

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
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
        head = self.raw[:40]
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
        return orjson.Fragment(value.raw)
    raise TypeError(f"cannot encode {type(value).__name__}")


#: ``Opaque`` values at least this large are spliced into ``encode_line``'s line, not encoded.
SPLICE_BYTES = 64 * 1024
#: Where ``encode_line`` splices one: orjson escapes a NUL in every string it writes, and valid
#: JSON holds none, so a raw one in its output is a mark.
_MARK = b"\x00"
_MARK_FRAGMENT = orjson.Fragment(_MARK)


def encode_line(value: Any) -> bytes:
    """``value`` as JSON ending with a newline (an NDJSON line), its ``Opaque`` values raw as
    ``encode_opaque`` writes them: the same bytes as ``orjson.dumps(value,
    default=encode_opaque) + b"\\n"``.

    Each ``Opaque`` of ``SPLICE_BYTES`` or more is copied once, into the line itself: orjson
    would copy it into its growing buffer, then into its bytes, then the newline's join into
    fresh memory again (an S2 line holds a 350 KB state). It is encoded as a mark, and the
    line joined from the pieces between the marks and the raw values. The newline is joined
    rather than ``OPT_APPEND_NEWLINE``'d: orjson's own buffer is not shrunk to fit (an S1 line
    of 5.4 KB held 16 KB), the joined copy is."""
    large: list[bytes] = []

    def default(item: Any) -> Any:
        if isinstance(item, Opaque) and len(item.raw) >= SPLICE_BYTES:
            large.append(item.raw)
            return _MARK_FRAGMENT
        return encode_opaque(item)

    encoded = orjson.dumps(value, default=default)
    if not large:
        return encoded + b"\n"
    pieces = encoded.split(_MARK)
    if len(pieces) != len(large) + 1:  # a NUL in a small one (not JSON): the plain copies
        return orjson.dumps(value, default=encode_opaque) + b"\n"
    joined = [pieces[0]]
    for raw, piece in zip(large, pieces[1:], strict=True):
        joined += (raw, piece)
    joined.append(b"\n")
    return b"".join(joined)
