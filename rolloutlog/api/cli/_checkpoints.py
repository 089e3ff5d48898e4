"""``rolloutlog checkpoint`` takes one; ``rolloutlog checkpoints`` lists them, shows one or
its manifest (``/v1/runs/{run}/checkpoints``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from rolloutlog.api.cli._main import (
    EXIT_OK,
    EXIT_REFUSED,
    CheckpointRef,
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
    json_lines,
    listing,
    stdout,
    table,
    tally,
    when,
)

if TYPE_CHECKING:
    from rolloutlog.trainer import CheckpointInfo, TrainerClient

__all__ = ["checkpoint", "checkpoints"]


def _show_checkpoint(info: CheckpointInfo) -> None:
    raw = info.raw
    print(f"checkpoint {info.checkpoint_id}: {info.status}", file=stdout())
    total = info.timings_ms.get("total")
    stages = {k: v for k, v in info.timings_ms.items() if k != "total"}
    fields(
        [
            ("counts", tally(dict(info.counts))),
            ("total", None if total is None else f"{total:.1f} ms"),
            ("stages", " ".join(f"{k}={v:.1f}ms" for k, v in stages.items()) or None),
            ("trigger", raw.get("trigger")),
            ("requested", when(raw.get("requested_at"))),
            ("reason", raw.get("reason")),
            *(
                [("staging", f"{len(info.staging_keys)} keys still referenced")]
                if info.staging_keys is not None
                else []
            ),
        ],
        stdout(),
    )


@click.command()
@run_argument
@click.option(
    "--deadline",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds the service waits for open wait steps before it gives up (default: its own).",
)
@click.option(
    "--no-wait",
    is_flag=True,
    help="Return at once with the checkpoint pending (follow it with 'checkpoints RUN ID').",
)
@controller_options
@client_command
@json_option
def checkpoint(
    client: TrainerClient,
    run: str,
    deadline: float | None,
    no_wait: bool,
    take_over: bool,
    epoch: int | None,
    as_json: bool,
) -> int:
    """Take a checkpoint of RUN and wait until it is committed (or aborted).

    Exits 1 when the checkpoint aborted or expired."""
    controller = controller_epoch(client, run, take_over, epoch)
    with Progress(f"checkpointing {run}", not as_json and not no_wait):
        info = client.checkpoint(
            run, controller_epoch=controller, deadline_s=deadline, wait=not no_wait, trigger="cli"
        )
        if info.status == "pending" and not no_wait:
            info = client.wait_for_checkpoint(run, info.checkpoint_id)
    if as_json:
        json_line(dict(info.raw), stdout())
    else:
        _show_checkpoint(info)
    return EXIT_OK if info.status in ("committed", "pending") else EXIT_REFUSED


@click.command()
@run_argument
@click.argument("checkpoint_id", metavar="[ID|latest]", required=False, type=CheckpointRef())
@click.option(
    "--status",
    type=click.Choice(["pending", "committed", "aborted", "expired"]),
    help="List only checkpoints in this status.",
)
@limit_option(100, "List at most this many, newest first.")
@click.option(
    "--manifest",
    is_flag=True,
    help="With ID: list the checkpoint's manifest (each episode's action, attempt and cut).",
)
@client_command
@json_option
def checkpoints(
    client: TrainerClient,
    run: str,
    checkpoint_id: int | str | None,
    status: str | None,
    limit: int,
    manifest: bool,
    as_json: bool,
) -> int:
    """List RUN's checkpoints, newest first; or show checkpoint ID (or the latest committed)."""
    if manifest and checkpoint_id is None:
        raise click.UsageError(
            "--manifest needs a checkpoint: checkpoints RUN ID --manifest",
            click.get_current_context(),
        )
    if checkpoint_id is not None:
        info = client.get_checkpoint(run, checkpoint_id)  # type: ignore[arg-type]
        if manifest:
            return _manifest(client, run, info.checkpoint_id, as_json)
        if as_json:
            json_line(dict(info.raw), stdout())
        else:
            _show_checkpoint(info)
        return EXIT_OK
    found = client.list_checkpoints(run, status=status, limit=limit)
    columns: list[Column] = [
        ("ID", lambda c: c["checkpoint_id"]),
        ("STATUS", lambda c: c["status"]),
        ("TRIGGER", lambda c: c.get("trigger")),
        ("CONTINUE", lambda c: c["counts"]["continue"]),
        ("RESTART", lambda c: c["counts"]["restart"]),
        ("FINISHED", lambda c: c["counts"]["finished"]),
        ("REQUESTED", lambda c: when(c.get("requested_at"))),
        ("TOTAL_MS", lambda c: c.get("timings_ms", {}).get("total")),
        ("REASON", lambda c: c.get("reason")),
    ]
    listing([dict(c.raw) for c in found], columns, as_json, "(no checkpoints)")
    return EXIT_OK


def _manifest(client: TrainerClient, run: str, checkpoint_id: int, as_json: bool) -> int:
    entries = client.manifest(run, checkpoint_id)
    if as_json:
        json_lines(entries, stdout())
        return EXIT_OK
    columns: list[Column] = [
        ("EPISODE", lambda e: e["episode"]),
        ("ACTION", lambda e: e["action"]),
        ("ATTEMPT", lambda e: e["attempt"]),
        ("CAPTURE_KEY", lambda e: e["capture_key"]),
        ("CUT", lambda e: f"{e['cut']['partition']}:{e['cut']['offset']}"),
        ("LAST_STAGE", lambda e: e.get("last_stage")),
    ]
    if not table(entries, columns, stdout()):
        print(f"(checkpoint {checkpoint_id} holds no episode)", file=stdout())
    return EXIT_OK
