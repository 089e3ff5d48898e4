"""``rolloutlog runs fork SOURCE RUN``: create RUN as a fork of SOURCE's committed checkpoint
(``POST /v1/runs`` with ``fork``; ``runs show`` prints the lineage)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import click

from rolloutlog.api.cli._main import (
    EXIT_OK,
    checkpoint_option,
    client_command,
    json_option,
    run_argument,
)
from rolloutlog.api.cli._output import json_line, stdout, tally
from rolloutlog.api.cli._runs import runs

if TYPE_CHECKING:
    from rolloutlog.trainer import TrainerClient

__all__ = ["runs_fork"]


def _names(values: Sequence[str]) -> list[str]:
    """Episode names given repeated or comma-separated."""
    return [name for value in values for name in value.split(",") if name]


@runs.command("fork")
@click.argument("source")
@run_argument
@checkpoint_option("The source's committed checkpoint to fork: its id, or 'latest'.")
@click.option(
    "--episodes",
    multiple=True,
    metavar="EPISODE[,EPISODE...]",
    help="Fork only these live episodes (repeat or separate with commas; default: all).",
)
@click.option(
    "--exclude",
    multiple=True,
    metavar="EPISODE[,EPISODE...]",
    help="Leave these live episodes out of the fork.",
)
@client_command
@json_option
def runs_fork(
    client: TrainerClient,
    source: str,
    run: str,
    checkpoint_id: int | str,
    episodes: Sequence[str],
    exclude: Sequence[str],
    as_json: bool,
) -> int:
    """Create RUN as a fork of SOURCE's committed checkpoint: its live episodes continue in
    RUN's own restores (``restore RUN``), while SOURCE goes on untouched."""
    created = client.fork_run(
        run,
        source,
        checkpoint_id,
        episodes=_names(episodes) or None,
        exclude=_names(exclude) or None,
    )
    if as_json:
        json_line(created, stdout())
        return EXIT_OK
    origin = created["forked_from"]
    counts = created.get("counts")
    what = f": {tally(counts)}" if counts else " (it existed)"
    print(
        f"run {created['run']} forked from {origin['run']}@{origin['checkpoint_id']}{what}",
        file=stdout(),
    )
    return EXIT_OK
