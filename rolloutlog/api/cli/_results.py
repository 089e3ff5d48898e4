"""``rolloutlog results``: finished episodes' results as the service keeps them, and their
acknowledgement by the trainer (``GET /v1/runs/{run}/results``, ``POST …/results/ack``)."""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any

import click
import orjson

from rolloutlog.api.cli._main import (
    EXIT_OK,
    DefaultGroup,
    client_command,
    json_option,
    run_argument,
)
from rolloutlog.api.cli._output import Column, json_line, listing, when

if TYPE_CHECKING:
    from rolloutlog.trainer import TrainerClient

__all__ = ["results"]

#: A result's JSON, cut to this many characters in the table (``--json`` prints it whole).
RESULT_WIDTH = 40


def _short(value: Any) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= RESULT_WIDTH else text[: RESULT_WIDTH - 1] + "…"


@click.group(cls=DefaultGroup, default="list")
def results() -> None:
    """Finished episodes' results: list them (the default: results RUN), or acknowledge
    the ones the trainer holds (results ack RUN EPISODE…)."""


@results.command("list")
@run_argument
@click.option(
    "--unacknowledged",
    is_flag=True,
    help="Only results the trainer has not acknowledged (those a crash kept from it).",
)
@click.option(
    "--since-checkpoint",
    type=click.IntRange(min=1),
    metavar="ID",
    help="Only results that finished at or past checkpoint ID's cut.",
)
@click.option(
    "--episode",
    "episodes",
    multiple=True,
    metavar="EPISODE",
    help="Only this episode's result (repeat for several).",
)
@client_command
@json_option
def results_list(
    client: TrainerClient,
    run: str,
    unacknowledged: bool,
    since_checkpoint: int | None,
    episodes: tuple[str, ...],
    as_json: bool,
) -> int:
    """List RUN's finished results by episode: attempt, capture key, reward, result."""
    found = client.results(
        run,
        since_checkpoint=since_checkpoint,
        episodes=episodes or None,
        unacknowledged=unacknowledged,
    )
    columns: list[Column] = [
        ("EPISODE", lambda r: r["episode"]),
        ("ATTEMPT", lambda r: r["attempt"]),
        ("CAPTURE_KEY", lambda r: r["capture_key"]),
        ("REWARD", lambda r: None if r["reward"] is None else f"{r['reward']:g}"),
        ("ACKED", lambda r: r["acknowledged"]),
        ("FINISHED", lambda r: when(r["ts"])),
        ("RESULT", lambda r: _short(r["result"])),
    ]
    listing([dataclasses.asdict(r) for r in found], columns, as_json, "(no results)")
    return EXIT_OK


@results.command("ack")
@run_argument
@click.argument("episodes", nargs=-1, required=True, metavar="EPISODE...")
@client_command
@json_option
def results_ack(client: TrainerClient, run: str, episodes: tuple[str, ...], as_json: bool) -> int:
    """Acknowledge the results of EPISODE… of RUN: the trainer holds them, a restore need not
    hand them back (idempotent)."""
    acknowledged = client.ack_results(run, episodes)
    if as_json:
        json_line({"run": run, "acknowledged": acknowledged}, sys.stdout)
    else:
        print(f"acknowledged {acknowledged} of {len(set(episodes))} results", file=sys.stdout)
    return EXIT_OK
