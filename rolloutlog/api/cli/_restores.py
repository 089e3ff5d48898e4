"""``rolloutlog restore`` restores a run from a committed checkpoint; ``rolloutlog restores``
lists them or shows one with its episodes (``/v1/runs/{run}/restores``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rolloutlog.api.cli._main import (
    EXIT_OK,
    checkpoint_option,
    client_command,
    controller_epoch,
    controller_options,
    json_option,
    limit_option,
    run_argument,
)
from rolloutlog.api.cli._output import (
    Column,
    Progress,
    fields,
    json_line,
    listing,
    stdout,
    table,
    tally,
    when,
)

if TYPE_CHECKING:
    from rolloutlog.trainer import RestoreInfo, TrainerClient

__all__ = ["restore", "restores"]

RESTORE_EPISODE_COLUMNS: list[Column] = [
    ("EPISODE", lambda e: e["episode"]),
    ("ACTION", lambda e: e["action"]),
    ("ATTEMPT", lambda e: f"{e['previous_attempt']}->{e['attempt']}"),
    ("CAPTURE_KEY", lambda e: e["capture_key"]),
    ("REASON", lambda e: e["reason"]),
]


def _show_restore(info: RestoreInfo, episodes: Sequence[Mapping[str, Any]] | None) -> None:
    print(f"restore {info.restore_id} from checkpoint {info.checkpoint_id}", file=stdout())
    total = info.timings_ms.get("total")
    fields(
        [
            ("counts", tally(dict(info.counts))),
            ("total", None if total is None else f"{total:.1f} ms"),
            ("controller", info.raw.get("controller_epoch")),
            ("committed", when(info.raw.get("committed_at"))),
        ],
        stdout(),
    )
    if episodes:
        table(episodes, RESTORE_EPISODE_COLUMNS, stdout())


def _excluded(exclude: Sequence[str], exclude_file: Path | None) -> list[str]:
    found = list(exclude)
    if exclude_file is not None:
        try:
            text = exclude_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise click.BadParameter(
                str(e), click.get_current_context(), param_hint="'--exclude-file'"
            ) from e
        found.extend(line.strip() for line in text.splitlines() if line.strip())
    return found


@click.command()
@run_argument
@checkpoint_option("Committed checkpoint to restore from: its id, or 'latest'.")
@click.option(
    "--exclude",
    multiple=True,
    metavar="EPISODE",
    help="An episode whose result you hold: it is not resumed (repeat for several).",
)
@click.option(
    "--exclude-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A file of episodes to exclude, one per line.",
)
@click.option(
    "--policy-version",
    type=click.IntRange(min=0),
    help="The trainer's current policy version (for --max-policy-lag).",
)
@click.option(
    "--max-policy-lag",
    type=click.IntRange(min=0),
    help="Restart rather than continue episodes whose policy lags more versions than this.",
)
@click.option(
    "--exclude-results",
    is_flag=True,
    help="Also exclude the episodes whose finished result the service holds (see 'results').",
)
@click.option("--episodes", is_flag=True, help="Also list the restored episodes and their fate.")
@controller_options
@client_command
@json_option
def restore(
    client: TrainerClient,
    run: str,
    checkpoint_id: int | str,
    exclude: tuple[str, ...],
    exclude_file: Path | None,
    policy_version: int | None,
    max_policy_lag: int | None,
    exclude_results: bool,
    episodes: bool,
    take_over: bool,
    epoch: int | None,
    as_json: bool,
) -> int:
    """Restore RUN from a committed checkpoint: each episode continues, restarts or stays
    excluded (all or nothing)."""
    excluded = _excluded(exclude, exclude_file)
    controller = controller_epoch(client, run, take_over, epoch)
    with Progress(f"restoring {run}", not as_json):
        info = client.restore(
            run,
            checkpoint_id=checkpoint_id,  # type: ignore[arg-type]
            exclude=excluded,
            policy_version=policy_version,
            max_policy_lag=max_policy_lag,
            controller_epoch=controller,
            exclude_results=exclude_results,
        )
        entries = (
            [dataclasses.asdict(e) for e in client.restore_episodes(run, info.restore_id)]
            if episodes
            else None
        )
    if as_json:
        json_line({**info.raw, **({"episodes": entries} if entries is not None else {})}, stdout())
    else:
        _show_restore(info, entries)
    return EXIT_OK


@click.command()
@run_argument
@click.argument("restore_id", metavar="[ID]", required=False, type=click.IntRange(min=1))
@limit_option(100, "List at most this many, newest first.")
@client_command
@json_option
def restores(
    client: TrainerClient, run: str, restore_id: int | None, limit: int, as_json: bool
) -> int:
    """List RUN's restores, newest first; or show restore ID with its episodes."""
    if restore_id is not None:
        info = client.get_restore(run, restore_id)
        entries = [dataclasses.asdict(e) for e in info.episodes or ()]
        if as_json:
            json_line({**info.raw, "episodes": entries}, stdout())
        else:
            _show_restore(info, entries)
        return EXIT_OK
    found = client.list_restores(run, limit=limit)
    columns: list[Column] = [
        ("ID", lambda r: r["restore_id"]),
        ("CHECKPOINT", lambda r: r["checkpoint_id"]),
        ("CONTINUE", lambda r: r["counts"].get("continue")),
        ("RESTART", lambda r: r["counts"].get("restart")),
        ("EXCLUDED", lambda r: r["counts"].get("excluded")),
        ("EPOCH", lambda r: r.get("controller_epoch")),
        ("COMMITTED", lambda r: when(r.get("committed_at"))),
        ("TOTAL_MS", lambda r: r.get("timings_ms", {}).get("total")),
    ]
    listing([dict(r.raw) for r in found], columns, as_json, "(no restores)")
    return EXIT_OK
