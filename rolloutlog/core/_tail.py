"""The generation cut in an episode's tail (docs/design.md §4): the durable token prefix of the
latest policy call, read off the tail's generation chunks by their token counts. ``EpisodeFold``
keeps the chunks; this module reads them."""

from __future__ import annotations

import orjson

from rolloutlog.core._model import GenerationCut

__all__ = ["CallFacts", "Chunk", "CutChunks", "cut_chunks", "generation_cut"]

#: What a generation cut needs of a chunk's data: (parent call id, request digest, policy version,
#: staging key) — a tuple rather than the decoded dict, which a live episode's tail would keep
#: alive (~300 bytes an episode in the projector).
CallFacts = tuple[str | None, str, int, str | None]
#: One generation chunk in the tail: (start, token count, done, its call's facts, its token ids'
#: raw JSON when the state keeps payloads, its call id, its record's offset (None for a chunk a
#: state took from a projection)).
Chunk = tuple[int, int, bool, CallFacts, bytes | None, str, int | None]
#: A tail's generation cut: (call id, the chunks that make its durable prefix, terminal, the
#: chunk that describes it, problem).
CutChunks = tuple[str, list[Chunk], bool, Chunk, str | None]


def cut_chunks(
    call: str | None, constrained: frozenset[str], chunks: list[Chunk]
) -> CutChunks | None:
    """The generation cut of ``call`` (the tail's latest) among the tail's ``chunks``, by token
    counts, or None (never for a ``constrained`` call)."""
    if call is None or call in constrained:
        return None
    if len(chunks) != 1 or chunks[0][5] != call:
        chunks = [chunk for chunk in chunks if chunk[5] == call]
    if not chunks:
        return None
    if len(chunks) == 1:  # the common case (a manifest asks for every episode's cut)
        only = chunks[0]
        if only[0] != 0:
            return call, [], False, only, "chunks do not start at 0"
        if not only[1] and not only[2]:
            return call, [], False, only, None
        return call, [only], only[2], only, None
    by_start: dict[int, Chunk] = {}
    for chunk in chunks:
        by_start.setdefault(chunk[0], chunk)
    walked: list[Chunk] = []
    length, terminal = 0, False
    problem = None if 0 in by_start else "chunks do not start at 0"
    last = next(iter(by_start.values()))
    while length in by_start and not terminal:
        chunk = by_start[length]
        if not chunk[1] and not chunk[2]:
            break
        walked.append(chunk)
        length += chunk[1]
        terminal = chunk[2]
        last = chunk
    if problem is None and any(start > length for start in by_start):
        problem = f"chunks are not contiguous after token {length}"
    return call, walked, terminal, last, problem


def generation_cut(found: CutChunks | None) -> GenerationCut | None:
    """The cut ``cut_chunks`` found, as a value (its token ids when the chunks kept them)."""
    if found is None:
        return None
    call, walked, terminal, last, problem = found
    tokens: list[int] = []
    for chunk in walked:
        if chunk[4] is not None:
            tokens.extend(orjson.loads(chunk[4]))
    parent, request_digest, policy_version, staging_key = last[3]
    return GenerationCut(
        call_id=call,
        parent_call_id=parent,
        request_digest=request_digest,
        token_ids=tuple(tokens),
        terminal=terminal,
        policy_version=policy_version,
        staging_key=staging_key,
        problem=problem,
    )
