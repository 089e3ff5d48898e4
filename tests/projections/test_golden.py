"""Golden event streams (tests/golden/*.json), one per rule of docs/design.md §4/§5, replayed through the fold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rolloutlog.log import validate_event
from rolloutlog.projections import EpisodeProjection, project_events
from tests.golden import _build
from tests.projections.both_modes import check_both_modes

GOLDEN = Path(_build.__file__).resolve().parent
FIXTURES = sorted(GOLDEN.glob("*.json"))


def replay(fixture: dict[str, Any]) -> EpisodeProjection:
    events = [(item["offset"], validate_event(item["event"])) for item in fixture["events"]]
    restores = fixture["committed_restores"]
    return project_events(
        fixture["episode"], events, fixture["cut"], None if restores is None else set(restores)
    )


def check(projection: EpisodeProjection, expect: dict[str, Any]) -> None:
    for key, want in expect.items():
        if key == "boundaries":
            got: Any = {owner: b.stage for owner, b in projection.boundaries.items()}
        elif key == "boundary_states":
            got = {
                owner: b.state.value() if b.state else None
                for owner, b in projection.boundaries.items()
            }
        elif key == "sessions":
            got = {
                sid: {
                    "mode": s.mode,
                    "verify": s.verify,
                    "state": s.state.value() if s.state else None,
                }
                for sid, s in projection.sessions.items()
            }
        elif key == "ledger":
            got = [row.call_id for row in projection.ledger]
        elif key == "generation_cut":
            cut = projection.generation_cut
            got = (
                None
                if cut is None
                else {
                    "call_id": cut.call_id,
                    "tokens": len(cut.token_ids),
                    "terminal": cut.terminal,
                }
            )
        elif key == "open_waits":
            got = sorted(projection.open_waits)
        elif key == "restart_only":
            got = projection.restart_only_sessions()
        elif key == "staging_keys":
            got = list(projection.staging_keys)
        else:
            got = getattr(projection, key)
        assert got == want, f"{key}: got {got!r}, want {want!r}"


def test_there_is_a_fixture_per_rule() -> None:
    assert len(FIXTURES) >= 18


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_golden_stream(path: Path) -> None:
    fixture = orjson.loads(path.read_bytes())
    check(replay(fixture), fixture["expect"])


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_golden_stream_in_both_modes(path: Path) -> None:
    """The projector's trackers (no payloads, record by record, pinned and continued at each
    restore) agree with the full fold on the manifest entry, the verdict and the metadata."""
    fixture = orjson.loads(path.read_bytes())
    events = [(item["offset"], validate_event(item["event"])) for item in fixture["events"]]
    restores = fixture["committed_restores"]
    committed = None if restores is None else set(restores)
    for cut in range(fixture["cut"] + 1):  # at every position up to the fixture's cut
        check_both_modes(fixture["episode"], events, cut, committed)


def test_fixtures_match_their_builder() -> None:
    built = {name: orjson.loads(orjson.dumps(f)) for name, f in _build.fixtures().items()}
    on_disk = {p.stem: orjson.loads(p.read_bytes()) for p in FIXTURES}
    stale = sorted(
        name for name in built.keys() | on_disk.keys() if built.get(name) != on_disk.get(name)
    )
    assert not stale, f"regenerate with `python -m tests.golden._build`: {stale}"
