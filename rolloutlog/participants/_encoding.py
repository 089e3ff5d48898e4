"""The SDK's own encoders and the check of the envelopes its participant classes build.

The participant classes build complete envelopes whose shape is fixed by the SDK; only a few
values come from the caller (episode ids, stage, session and call ids, digests, counts, token
lists, rewards). ``check_built`` has the envelope checker the append's fast path uses
(``core.envelope_holds``: the envelope valid as it is, every field there, payloads ``Opaque``)
vouch for it instead of pydantic; any envelope it does not take goes to ``validate_event``,
which stays the authority: it accepts what pydantic accepts and refuses with the same
``InvalidEvent`` (field and reason) otherwise.

Records are encoded by ``rolloutlog.log.encode_record_dict``, the record layout's own encoder for
dict envelopes (the same bytes as the codec's for a valid envelope, tested per event type); the
participant classes build envelopes in the envelope model's field order, which the layout's peeks
use when they can.
"""

from __future__ import annotations

from typing import Any

import orjson

from rolloutlog.core import envelope_holds
from rolloutlog.log import encode_opaque, encode_record, encode_record_dict, validate_event

__all__ = ["check_built", "encode_record_fast", "encode_wire"]


def encode_wire(event: dict[str, Any]) -> bytes:
    """An envelope as one JSON object (opaque payloads embedded as their raw bytes)."""
    return orjson.dumps(event, default=encode_opaque)


#: The SDK's record encoder is the log's (``rolloutlog.log``'s record layout, for dict envelopes).
encode_record_fast = encode_record_dict


def check_built(event: dict[str, Any]) -> bytes:
    """Check an envelope a participant class built and return its log record.

    The envelope checker vouches for what the SDK builds; anything else is validated by
    pydantic (raising ``InvalidEvent`` as the service would) and encoded by the codec.
    """
    if envelope_holds(event):
        return encode_record_fast(event)
    return encode_record(validate_event(event))
