"""Fencing cannot be poisoned: an epoch never granted, a seq near 2^63 or far past the
participant's last, an attempt no restore began, an unregistered participant — each is refused
by a real ``rolloutlog serve``, and the participant's following honest events are acknowledged
and are in the fold (the episode's projection at a checkpoint shows them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.faults._api import append, create_run, envelope, register, serve, take_over

RUN = "poison"


async def _projection(client: httpx.AsyncClient, episode: str) -> dict[str, Any]:
    controller = await take_over(client, RUN)
    response = await client.post(
        f"/v1/runs/{RUN}/checkpoints", json={"controller_epoch": controller, "deadline_s": 10}
    )
    assert response.status_code == 201, response.text
    checkpoint = response.json()["checkpoint_id"]
    response = await client.get(
        f"/v1/runs/{RUN}/episodes/{episode}/projection", params={"checkpoint": checkpoint}
    )
    assert response.status_code == 200, response.text
    projection: dict[str, Any] = response.json()
    return projection


async def test_poisoning_attempts_are_refused_and_honest_events_stay_in_the_fold(
    tmp_path: Path,
) -> None:
    async with serve(tmp_path) as served, httpx.AsyncClient(base_url=served.url) as client:
        await create_run(client, RUN)
        assert await register(client, RUN) == 1
        ok = await append(
            client, RUN, [envelope("e1", 1, type_="episode.started"), envelope("e1", 2)]
        )
        assert ok.status_code == 200, ok.text

        poisons: list[tuple[dict[str, Any], int, str, str | None]] = [
            (envelope("e1", 3, epoch=2), 409, "participant_fenced", None),  # never granted
            (envelope("e1", 2**62), 422, "invalid_event", "seq"),  # near 2^63
            (envelope("e1", 2**53 - 1), 422, "invalid_event", "seq"),  # absurd jump
            (envelope("e1", 3 + (1 << 21)), 422, "invalid_event", "seq"),  # past max_seq_gap
            (envelope("e1", 3, attempt=4), 409, "attempt_fenced", None),  # no restore began it
            (envelope("e1", 3, pid="intruder", epoch=9), 409, "participant_fenced", None),
        ]
        for poison, status, code, field in poisons:
            # Alone, and hidden after an honest event: all or nothing, nothing appended.
            for batch in ([poison], [envelope("e2", 3, type_="episode.started"), poison]):
                refused = await append(client, RUN, batch)
                assert refused.status_code == status, (poison, refused.text)
                error = refused.json()["error"]
                assert error["code"] == code, error
                assert error["details"]["index"] == len(batch) - 1
                if field is not None:
                    assert error["details"]["field"] == field

        honest = [envelope("e1", 3, stage="invoke_agent"), envelope("e1", 4, stage="verify")]
        accepted = await append(client, RUN, honest)
        assert accepted.status_code == 200, accepted.text
        # A retry of acknowledged events is acknowledged (the fold keeps the first copy).
        again = await append(client, RUN, honest)
        assert again.status_code == 200, again.text

        projection = await _projection(client, "e1")
        assert projection["boundaries"]["environment"]["stage"] == "verify"
        assert projection["boundaries"]["environment"]["state"] == {"stage": "verify"}
        assert served.alive()


async def test_restarts_and_retries_of_an_honest_participant_are_never_refused(
    tmp_path: Path,
) -> None:
    async with serve(tmp_path) as served, httpx.AsyncClient(base_url=served.url) as client:
        await create_run(client, RUN)
        assert await register(client, RUN) == 1
        first = [envelope("e1", 1, type_="episode.started"), envelope("e1", 2)]
        for _ in range(3):  # the first copy, then two retries
            response = await append(client, RUN, first)
            assert response.status_code == 200, response.text
        # A refused event's seq is spent; the next one still fits.
        refused = await append(client, RUN, [envelope("e1", 3, pid="env-0", epoch=5)])
        assert refused.status_code == 409
        response = await append(client, RUN, [envelope("e1", 4, stage="a")])
        assert response.status_code == 200, response.text
        # A restarted process registers again and counts its seqs from 1 under its new epoch.
        assert await register(client, RUN) == 2
        response = await append(client, RUN, [envelope("e1", 1, epoch=2, stage="b")])
        assert response.status_code == 200, response.text
        stale = await append(client, RUN, [envelope("e1", 5, epoch=1, stage="zombie")])
        assert stale.status_code == 409
        assert stale.json()["error"]["code"] == "participant_fenced"

        projection = await _projection(client, "e1")
        assert projection["boundaries"]["environment"]["stage"] == "b"
