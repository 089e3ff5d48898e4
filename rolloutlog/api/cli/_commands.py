"""The client commands: thin wrappers of ``rolloutlog.trainer.TrainerClient``, named after the
REST routes they call (docs/api.md): ``runs``, ``checkpoint``/``checkpoints``,
``restore``/``restores``, ``episodes``/``episode``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rolloutlog.api.cli._main import (
    EXIT_OK,
    EXIT_REFUSED,
    CheckpointRef,
    CliError,
    DefaultGroup,
    checkpoint_option,
    client_command,
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
    when,
)

if TYPE_CHECKING:
    from rolloutlog.trainer import CheckpointInfo, RestoreInfo, TrainerClient

__all__ = ["COMMANDS"]


def _counts(info: Mapping[str, Any]) -> str:
    return " ".join(f"{key}={value}" for key, value in info.items())


# -- runs --------------------------------------------------------------------------------------


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
            ("checkpoints", _counts(counts["checkpoints"]) or None),
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


# -- checkpoints -------------------------------------------------------------------------------


def _controller_options(f: Any) -> Any:
    f = click.option(
        "--epoch",
        type=click.IntRange(min=1),
        help="Act as this controller epoch (default: the run's current one).",
    )(f)
    return click.option(
        "--take-over",
        is_flag=True,
        help="Take over the run's controller first (fences the running trainer).",
    )(f)


def _epoch(client: TrainerClient, run: str, take_over: bool, epoch: int | None) -> int:
    """The controller epoch to act with: taken over, given, or the run's current one."""
    if take_over and epoch is not None:
        raise click.UsageError(
            "--take-over and --epoch exclude each other", click.get_current_context()
        )
    if take_over:
        return client.take_over(run)
    if epoch is not None:
        return epoch
    current = int(client.get_run(run)["controller_epoch"])
    if current == 0:
        raise CliError(
            "invalid_request",
            f"run {run!r} has no controller yet: pass --take-over (or --epoch N)",
            EXIT_REFUSED,
        )
    return current


def _show_checkpoint(info: CheckpointInfo) -> None:
    raw = info.raw
    print(f"checkpoint {info.checkpoint_id}: {info.status}", file=stdout())
    total = info.timings_ms.get("total")
    stages = {k: v for k, v in info.timings_ms.items() if k != "total"}
    fields(
        [
            ("counts", _counts(dict(info.counts))),
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
@_controller_options
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
    controller = _epoch(client, run, take_over, epoch)
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


# -- restores ----------------------------------------------------------------------------------

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
            ("counts", _counts(dict(info.counts))),
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
@_controller_options
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
    controller = _epoch(client, run, take_over, epoch)
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


# -- episodes ----------------------------------------------------------------------------------


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


COMMANDS: list[click.Command] = [
    runs,
    checkpoint,
    checkpoints,
    restore,
    restores,
    episodes,
    episode,
]
