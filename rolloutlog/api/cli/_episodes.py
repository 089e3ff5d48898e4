"""``rolloutlog episodes`` lists a run's episodes; ``rolloutlog episode`` shows one across its
attempts (``/v1/runs/{run}/episodes``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from rolloutlog.api.cli._main import (
    EXIT_OK,
    client_command,
    json_option,
    limit_option,
    run_argument,
)
from rolloutlog.api.cli._output import Column, json_line, listing, stdout, table, when

if TYPE_CHECKING:
    from rolloutlog.trainer import TrainerClient

__all__ = ["episode", "episodes"]


@click.command()
@run_argument
@click.option(
    "--status",
    type=click.Choice(["running", "finished", "excluded"]),
    help="List only episodes in this status.",
)
@client_command
@json_option
def episodes(client: TrainerClient, run: str, status: str | None, as_json: bool) -> int:
    """List RUN's episodes with their current attempt, capture key and status."""
    columns: list[Column] = [
        ("EPISODE", lambda e: e["episode"]),
        ("ATTEMPT", lambda e: e["current_attempt"]),
        ("CAPTURE_KEY", lambda e: e["capture_key"]),
        ("STATUS", lambda e: e["status"]),
        ("LIVE", lambda e: e["live"]),
        ("UPDATED", lambda e: when(e.get("updated_at"))),
    ]
    listing(
        client.episodes(run, status=status),
        columns,
        as_json,
        "(no episodes recorded yet: the catalog learns of episodes at checkpoints)",
    )
    return EXIT_OK


@click.command()
@run_argument
@click.argument("episode")
@click.option(
    "--after",
    type=click.IntRange(min=0),
    help="Show the timeline's events after this log offset (the next page).",
)
@limit_option(500, "Show at most this many events of the timeline.")
@client_command
@json_option
def episode(
    client: TrainerClient,
    run: str,
    episode: str,
    after: int | None,
    limit: int,
    as_json: bool,
) -> int:
    """Show EPISODE of RUN across its attempts: why each began, what checkpoints and restores
    decided for it, and its event timeline (payloads left out)."""
    history = client.episode_history(run, episode, after=after, limit=limit)
    if as_json:
        json_line(history, stdout())
        return EXIT_OK
    print(
        f"episode {history['episode']} of run {history['run']}: {history['status'] or '-'}, "
        f"attempt {history['current_attempt']}, partition {history['partition']}",
        file=stdout(),
    )
    print("attempts", file=stdout())
    table(
        history["attempts"],
        [
            ("ATTEMPT", lambda a: a["attempt"]),
            ("CAPTURE_KEY", lambda a: a["capture_key"]),
            ("EVENTS", lambda a: a["events"]),
            ("WHY", lambda a: a["why"]),
        ],
        stdout(),
    )
    if history["checkpoints"]:
        print("checkpoints", file=stdout())
        table(
            history["checkpoints"],
            [
                ("CHECKPOINT", lambda c: c.get("checkpoint_id")),
                ("ACTION", lambda c: c.get("action")),
                ("ATTEMPT", lambda c: c.get("attempt")),
                ("LAST_STAGE", lambda c: c.get("last_stage")),
            ],
            stdout(),
        )
    if history["restores"]:
        print("restores", file=stdout())
        table(
            history["restores"],
            [
                ("RESTORE", lambda r: r.get("restore_id")),
                ("CHECKPOINT", lambda r: r.get("checkpoint_id")),
                ("ACTION", lambda r: r["action"]),
                ("ATTEMPT", lambda r: f"{r['previous_attempt']}->{r['attempt']}"),
                ("WHY", lambda r: r.get("explanation") or r.get("reason")),
            ],
            stdout(),
        )
    print(f"events ({history['event_count']})", file=stdout())
    table(
        history["events"],
        [
            ("OFFSET", lambda e: e.get("offset")),
            ("TYPE", lambda e: e.get("type")),
            ("ATTEMPT", lambda e: e.get("attempt")),
            ("STEP", lambda e: e.get("step")),
            ("PARTICIPANT", lambda e: e.get("participant")),
            ("STAGE", lambda e: e.get("stage")),
            ("BYTES", lambda e: e.get("size_bytes")),
        ],
        stdout(),
    )
    if history.get("next_after") is not None:
        print(f"(more events: --after {history['next_after']})", file=stdout())
    return EXIT_OK
