"""The analyst's views of a run: ``participants``, ``quarantine``, ``projector`` (its lag per
partition) and one episode's ``projection`` (docs/api.md, routes of the same names)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from rolloutlog.api.cli._main import (
    EXIT_OK,
    CheckpointRef,
    client_command,
    json_option,
    limit_option,
    run_argument,
)
from rolloutlog.api.cli._output import Column, fields, json_line, listing, stdout, table, when

if TYPE_CHECKING:
    from rolloutlog.trainer import TrainerClient

__all__ = ["ANALYST_COMMANDS"]


@click.command()
@run_argument
@client_command
@json_option
def participants(client: TrainerClient, run: str, as_json: bool) -> int:
    """List RUN's registered participants: kind, fencing epoch, when registered and last seen."""
    columns: list[Column] = [
        ("ID", lambda p: p["id"]),
        ("KIND", lambda p: p["kind"]),
        ("EPOCH", lambda p: p["epoch"]),
        ("REGISTERED", lambda p: when(p.get("registered_at"))),
        ("LAST_SEEN", lambda p: when(p.get("last_seen_at"))),
    ]
    listing(client.participants(run), columns, as_json, "(no participants)")
    return EXIT_OK


@click.command()
@run_argument
@click.option(
    "--after",
    metavar="PARTITION:OFFSET",
    help="List the records after this position (the next page).",
)
@limit_option(1000, "List at most this many records, by partition and offset.", most=10_000)
@client_command
@json_option
def quarantine(
    client: TrainerClient, run: str, after: str | None, limit: int, as_json: bool
) -> int:
    """List RUN's quarantined log records: the ones the projector skipped (not a valid
    envelope, or the fold could not apply them), with the reason and their first bytes."""
    page = client.quarantine(run, after=after, limit=limit)
    columns: list[Column] = [
        ("PARTITION", lambda r: r["partition"]),
        ("OFFSET", lambda r: r["offset"]),
        ("SIZE", lambda r: r["size"]),
        ("RECORDED", lambda r: when(r.get("recorded_at"))),
        ("REASON", lambda r: r["reason"]),
        ("FIRST_BYTES", lambda r: repr(r["first_bytes"])),
    ]
    listing(page["records"], columns, as_json, "(no quarantined records)")
    if not as_json and page.get("next_after") is not None:
        print(f"(more records: --after {page['next_after']})", file=stdout())
    return EXIT_OK


@click.command()
@run_argument
@client_command
@json_option
def projector(client: TrainerClient, run: str, as_json: bool) -> int:
    """Show how far this service's projector trails RUN's log: records behind, per partition."""
    lag = client.projector(run)
    if as_json:
        json_line(lag, stdout())
        return EXIT_OK
    print(
        f"projector of run {lag['run']}: {lag['lag']} records behind of {lag['log_records']}",
        file=stdout(),
    )
    columns: list[Column] = [
        ("PARTITION", lambda p: p["partition"]),
        ("END_OFFSET", lambda p: p["end_offset"]),
        ("APPLIED", lambda p: p["applied"]),
        ("LAG", lambda p: p["lag"]),
    ]
    table(lag["partitions"], columns, stdout())
    return EXIT_OK


@click.command()
@run_argument
@click.argument("episode")
@click.option(
    "--restore",
    "restore_id",
    type=CheckpointRef(),
    metavar="ID|latest",
    help="The episode's projection as restore ID (or the latest restore) handed it on.",
)
@click.option(
    "--checkpoint",
    "checkpoint_id",
    type=click.IntRange(min=1),
    metavar="ID",
    help="The episode's projection at checkpoint ID's cut.",
)
@client_command
@json_option
def projection(
    client: TrainerClient,
    run: str,
    episode: str,
    restore_id: int | str | None,
    checkpoint_id: int | None,
    as_json: bool,
) -> int:
    """Show EPISODE's projection of RUN (its state, boundaries, sessions, ledger and generation
    cut) as a restore or a checkpoint has it; give exactly one of --restore and --checkpoint.

    The projection routes are the participants': the token needs the participant role (or
    admin)."""
    if (restore_id is None) == (checkpoint_id is None):
        raise click.UsageError(
            "give exactly one of --restore ID|latest and --checkpoint ID",
            click.get_current_context(),
        )
    found = client.projection(
        run,
        episode,
        restore=restore_id,  # type: ignore[arg-type]
        checkpoint=checkpoint_id,
    )
    if as_json:
        json_line(found, stdout())
        return EXIT_OK
    print(
        f"episode {found['episode']}: {found.get('status') or '-'}, attempt {found['attempt']}, "
        f"capture key {found['capture_key']}",
        file=stdout(),
    )
    cut = found.get("generation_cut")
    fields(
        [
            ("task_digest", found.get("task_digest")),
            ("ledger", f"{len(found.get('ledger') or ())} rows"),
            ("generation_cut", None if cut is None else cut.get("call_id")),
        ],
        stdout(),
    )
    boundaries = found.get("boundaries") or {}
    if boundaries:
        print("boundaries", file=stdout())
        table(
            ({"owner": owner, **b} for owner, b in boundaries.items()),
            [
                ("OWNER", lambda b: b["owner"]),
                ("STAGE", lambda b: b.get("stage")),
                ("NEXT", lambda b: b.get("next")),
                ("STEP", lambda b: b.get("step")),
            ],
            stdout(),
        )
    sessions = found.get("sessions") or {}
    if sessions:
        print("sessions", file=stdout())
        table(
            ({"id": key, **s} for key, s in sessions.items()),
            [
                ("SESSION", lambda s: s["id"]),
                ("KIND", lambda s: s.get("kind")),
                ("PARTICIPANT", lambda s: s.get("participant")),
                ("MODE", lambda s: s.get("mode")),
                ("VERIFY", lambda s: s.get("verify")),
            ],
            stdout(),
        )
    return EXIT_OK


ANALYST_COMMANDS: list[click.Command] = [participants, quarantine, projector, projection]
