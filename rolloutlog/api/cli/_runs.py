"""``rolloutlog runs``: list the runs (the default), show, create or delete one
(``/v1/runs``; ``runs fork`` is in ``_forks``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import click

from rolloutlog.api.cli._main import (
    EXIT_OK,
    DefaultGroup,
    client_command,
    json_option,
    run_argument,
)
from rolloutlog.api.cli._output import Column, fields, json_line, listing, stdout, tally, when

if TYPE_CHECKING:
    from rolloutlog.trainer import TrainerClient

__all__ = ["runs"]


@click.group(cls=DefaultGroup, default="list")
def runs() -> None:
    """Runs: list them (the default), show, create, fork or delete one."""


RUN_COLUMNS: list[Column] = [
    ("RUN", lambda r: r["run"]),
    ("PARTITIONS", lambda r: r["partitions"]),
    ("EPOCH", lambda r: r["controller_epoch"]),
    ("LATEST", lambda r: r["latest_checkpoint_id"]),
    ("COMMITTED", lambda r: r["counts"]["checkpoints"].get("committed", 0)),
    ("RESTORES", lambda r: r["counts"]["restores"]),
    ("EPISODES", lambda r: r["counts"]["episodes"]),
    ("LIVE", lambda r: r["counts"].get("live_episodes")),
    ("HEALTH", lambda r: (r.get("health") or {}).get("status")),
    ("CREATED", lambda r: when(r["created_at"])),
]


@runs.command("list")
@client_command
@json_option
def runs_list(client: TrainerClient, as_json: bool) -> int:
    """List the runs with their counts and health."""
    listing(client.list_runs(), RUN_COLUMNS, as_json, "(no runs)")
    return EXIT_OK


def _flat(value: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested objects as ``a.b.c  value`` rows."""
    rows: list[tuple[str, Any]] = []
    for key, item in value.items():
        if isinstance(item, Mapping) and item:
            rows.extend(_flat(item, f"{prefix}{key}."))
        else:
            rows.append((f"{prefix}{key}", item))
    return rows


@runs.command("show")
@run_argument
@click.option(
    "--stats",
    is_flag=True,
    help="Also show the run's statistics: events, bytes, checkpoint and restore timings.",
)
@client_command
@json_option
def runs_show(client: TrainerClient, run: str, stats: bool, as_json: bool) -> int:
    """Show RUN: partitions, log, controller, counts and health."""
    found = client.get_run(run)
    extra = client.stats(run) if stats else None
    if as_json:
        json_line({**found, **({"stats": extra} if extra is not None else {})}, stdout())
        return EXIT_OK
    counts = found["counts"]
    health = found.get("health") or {}
    print(f"run {found['run']}", file=stdout())
    fields(
        [
            ("partitions", found["partitions"]),
            ("log", found.get("log_url")),
            ("controller", found["controller_epoch"]),
            ("latest", found["latest_checkpoint_id"]),
            ("checkpoints", tally(counts["checkpoints"]) or None),
            ("restores", counts["restores"]),
            ("episodes", f"{counts['episodes']} ({counts.get('live_episodes', 0)} live)"),
            ("health", " ".join(str(v) for v in (health.get("status"), health.get("error")) if v)),
            *(
                (f"held back p{b['partition']}", f"{b['replica'] or 'nobody'} {b['state']}")
                for b in health.get("held_back") or ()
            ),
            ("created", when(found["created_at"])),
            *_lineage(found),
        ],
        stdout(),
    )
    if extra is not None:
        print("stats", file=stdout())
        fields((row for row in _flat(extra) if row[0] != "run"), stdout())
    return EXIT_OK


@runs.command("create")
@run_argument
@click.option(
    "--partitions",
    type=click.IntRange(1, 256),
    help="Log partitions of the run, 1 to 256 (default: the service's, 16).",
)
@client_command
@json_option
def runs_create(client: TrainerClient, run: str, partitions: int | None, as_json: bool) -> int:
    """Create RUN (nothing changes if it exists with the same settings)."""
    created = client.create_run(run, partitions)
    if as_json:
        json_line(created, stdout())
    else:
        print(f"run {created['run']}: {created['partitions']} partitions", file=stdout())
    return EXIT_OK


def _lineage(found: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``forked from SOURCE@CHECKPOINT`` (the checkpoint alone when the token holds no role
    on the source, whose name the service then leaves out) and one ``fork`` row per fork."""
    rows: list[tuple[str, Any]] = []
    origin = found.get("forked_from")
    if origin:
        source = origin["run"]
        shown = (
            f"{source}@{origin['checkpoint_id']}"
            if source is not None
            else f"checkpoint {origin['checkpoint_id']} of a run out of this token's scope"
        )
        rows.append(("forked from", shown))
    for fork in found.get("forks") or ():
        rows.append(("fork", f"{fork['run']} (from checkpoint {fork['checkpoint_id']})"))
    return rows


@runs.command("delete")
@run_argument
@client_command
@json_option
def runs_delete(client: TrainerClient, run: str, as_json: bool) -> int:
    """Delete RUN for good: its log, catalog rows and the service's resources for it."""
    deleted = client.delete_run(run)
    if as_json:
        json_line(deleted, stdout())
    else:
        print(f"deleted run {run}", file=stdout())
    return EXIT_OK
