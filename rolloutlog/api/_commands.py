"""The CLI's REST client commands: ``runs``, ``checkpoint``, ``restore``, ``checkpoints``,
``episodes`` — thin wrappers of ``rolloutlog.trainer.TrainerClient`` with readable tables."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, TextIO

import orjson

from rolloutlog.errors import InvalidRequest
from rolloutlog.trainer import CheckpointInfo, TrainerClient

__all__ = ["COMMANDS", "Progress", "table"]

Column = tuple[str, Callable[[dict[str, Any]], Any]]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def table(rows: Iterable[dict[str, Any]], columns: Sequence[Column], out: TextIO) -> int:
    """Print rows as an aligned table; returns how many rows it printed."""
    cells = [[_cell(get(row)) for _, get in columns] for row in rows]
    headers = [header for header, _ in columns]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(), file=out)
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(), file=out)
    return len(cells)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


class Progress:
    """A spinner with the elapsed time on stderr while a long call runs (TTYs only)."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _spin(self) -> None:
        frames = "|/-\\"
        index = 0
        while not self._stop.wait(0.1):
            elapsed = time.monotonic() - self.started
            sys.stderr.write(f"\r{frames[index % 4]} {self.label} {elapsed:5.1f} s")
            sys.stderr.flush()
            index += 1

    def __enter__(self) -> Progress:
        if self.enabled:
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _json(value: Any, out: TextIO) -> None:
    out.write(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n")


def _epoch(client: TrainerClient, args: argparse.Namespace) -> int:
    """The controller epoch to act with: taken over, given, or the run's current one."""
    if args.take_over:
        return client.take_over(args.run)
    if args.epoch is not None:
        return int(args.epoch)
    epoch = int(client.get_run(args.run)["controller_epoch"])
    if epoch == 0:
        raise InvalidRequest(
            f"run {args.run!r} has no controller yet: pass --take-over (or --epoch N)"
        )
    return epoch


def _counts(info: dict[str, Any]) -> str:
    return " ".join(f"{key}={value}" for key, value in info.items())


def cmd_runs(client: TrainerClient, args: argparse.Namespace, out: TextIO) -> int:
    if args.action == "delete":
        return _delete_run(client, args, out)
    if args.run is not None:
        raise InvalidRequest(f"unexpected argument {args.run!r}: did you mean 'runs delete RUN'?")
    runs = client.list_runs()
    if args.json:
        _json(runs, out)
        return 0
    columns: list[Column] = [
        ("RUN", lambda r: r["run"]),
        ("PARTITIONS", lambda r: r["partitions"]),
        ("EPOCH", lambda r: r["controller_epoch"]),
        ("LATEST", lambda r: r["latest_checkpoint_id"]),
        ("COMMITTED", lambda r: r["counts"]["checkpoints"].get("committed", 0)),
        ("RESTORES", lambda r: r["counts"]["restores"]),
        ("EPISODES", lambda r: r["counts"]["episodes"]),
        ("LIVE", lambda r: r["counts"].get("live_episodes")),
        ("CREATED", lambda r: _when(r["created_at"])),
    ]
    if not table(runs, columns, out):
        print("(no runs)", file=out)
    return 0


def _delete_run(client: TrainerClient, args: argparse.Namespace, out: TextIO) -> int:
    if args.run is None:
        raise InvalidRequest("runs delete needs the run to delete: rolloutlog runs delete RUN")
    result = client.delete_run(args.run)
    if args.json:
        _json(result, out)
    else:
        print(f"deleted run {args.run}", file=out)
    return 0


def _show_checkpoint(info: CheckpointInfo, out: TextIO) -> None:
    raw = info.raw
    print(f"checkpoint {info.checkpoint_id}: {info.status}", file=out)
    print(f"  counts     {_counts(dict(info.counts))}", file=out)
    total = info.timings_ms.get("total")
    if total is not None:
        print(f"  total      {total:.1f} ms", file=out)
    stages = {k: v for k, v in info.timings_ms.items() if k != "total"}
    if stages:
        print("  stages     " + " ".join(f"{k}={v:.1f}ms" for k, v in stages.items()), file=out)
    if raw.get("reason"):
        print(f"  reason     {raw['reason']}", file=out)
    if info.staging_keys is not None:
        print(f"  staging    {len(info.staging_keys)} keys still referenced", file=out)


def cmd_checkpoint(client: TrainerClient, args: argparse.Namespace, out: TextIO) -> int:
    epoch = _epoch(client, args)
    with Progress(f"checkpointing {args.run}", not args.json):
        info = client.checkpoint(
            args.run,
            controller_epoch=epoch,
            deadline_s=args.deadline,
            wait=not args.no_wait,
            trigger="cli",
        )
    if info.status == "pending" and not args.no_wait_for_commit:
        with Progress(f"checkpoint {info.checkpoint_id} pending", not args.json):
            info = client.wait_for_checkpoint(args.run, info.checkpoint_id)
    if args.json:
        _json(dict(info.raw), out)
    else:
        _show_checkpoint(info, out)
    return 0 if info.status in ("committed", "pending") else 1


def cmd_restore(client: TrainerClient, args: argparse.Namespace, out: TextIO) -> int:
    epoch = _epoch(client, args)
    exclude = list(args.exclude or ())
    if args.exclude_file:
        with open(args.exclude_file, encoding="utf-8") as handle:
            exclude.extend(line.strip() for line in handle if line.strip())
    checkpoint: int | str = "latest" if args.checkpoint == "latest" else int(args.checkpoint)
    with Progress(f"restoring {args.run}", not args.json):
        info = client.restore(
            args.run,
            checkpoint_id=checkpoint,  # type: ignore[arg-type]
            exclude=exclude,
            policy_version=args.policy_version,
            max_policy_lag=args.max_policy_lag,
            controller_epoch=epoch,
        )
        episodes = list(client.restore_episodes(args.run, info.restore_id)) if args.episodes else []
    if args.json:
        body = dict(info.raw)
        if args.episodes:
            body["episodes"] = [dataclasses.asdict(e) for e in episodes]
        _json(body, out)
        return 0
    print(f"restore {info.restore_id} from checkpoint {info.checkpoint_id}", file=out)
    print(f"  counts     {_counts(dict(info.counts))}", file=out)
    total = info.timings_ms.get("total")
    if total is not None:
        print(f"  total      {total:.1f} ms", file=out)
    if episodes:
        columns: list[Column] = [
            ("EPISODE", lambda e: e["episode"]),
            ("ACTION", lambda e: e["action"]),
            ("ATTEMPT", lambda e: f"{e['previous_attempt']}->{e['attempt']}"),
            ("CAPTURE_KEY", lambda e: e["capture_key"]),
            ("REASON", lambda e: e["reason"]),
        ]
        rows = [
            {
                "episode": e.episode,
                "action": e.action,
                "previous_attempt": e.previous_attempt,
                "attempt": e.attempt,
                "capture_key": e.capture_key,
                "reason": e.reason,
            }
            for e in episodes
        ]
        table(rows, columns, out)
    return 0


def cmd_checkpoints(client: TrainerClient, args: argparse.Namespace, out: TextIO) -> int:
    found = client.list_checkpoints(args.run, status=args.status, limit=args.limit)
    if args.json:
        _json([dict(c.raw) for c in found], out)
        return 0
    columns: list[Column] = [
        ("ID", lambda c: c["checkpoint_id"]),
        ("STATUS", lambda c: c["status"]),
        ("TRIGGER", lambda c: c.get("trigger")),
        ("CONTINUE", lambda c: c["counts"]["continue"]),
        ("RESTART", lambda c: c["counts"]["restart"]),
        ("FINISHED", lambda c: c["counts"]["finished"]),
        ("REQUESTED", lambda c: _when(c.get("requested_at"))),
        ("TOTAL_MS", lambda c: c.get("timings_ms", {}).get("total")),
        ("REASON", lambda c: c.get("reason")),
    ]
    if not table((dict(c.raw) for c in found), columns, out):
        print("(no checkpoints)", file=out)
    return 0


def cmd_episodes(client: TrainerClient, args: argparse.Namespace, out: TextIO) -> int:
    episodes = client.episodes(args.run, status=args.status)
    if args.json:
        for episode in episodes:
            out.write(orjson.dumps(episode).decode() + "\n")
        return 0
    columns: list[Column] = [
        ("EPISODE", lambda e: e["episode"]),
        ("ATTEMPT", lambda e: e["current_attempt"]),
        ("CAPTURE_KEY", lambda e: e["capture_key"]),
        ("STATUS", lambda e: e["status"]),
        ("LIVE", lambda e: e["live"]),
        ("UPDATED", lambda e: _when(e.get("updated_at"))),
    ]
    if not table(episodes, columns, out):
        print("(no episodes recorded yet: the catalog learns of episodes at checkpoints)", file=out)
    return 0


COMMANDS: dict[str, Callable[[TrainerClient, argparse.Namespace, TextIO], int]] = {
    "runs": cmd_runs,
    "checkpoint": cmd_checkpoint,
    "restore": cmd_restore,
    "checkpoints": cmd_checkpoints,
    "episodes": cmd_episodes,
}
