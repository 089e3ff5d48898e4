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
