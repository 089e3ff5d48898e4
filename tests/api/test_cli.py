"""The ``rolloutlog`` command's client side against a real server (``rolloutlog serve`` in a
subprocess): every command, the ``--json`` convention (JSON Lines), errors as ``CODE: message``
with their exit codes and no traceback, pipes, ``--no-wait``, completion, and help on every flag.

Most commands run in process through ``main(argv)`` (the same code as the console script, and
cheaper on a shared machine); what only a process shows — exit statuses, a closed pipe, the shell's
completion protocol, tracebacks — runs ``python -m rolloutlog.api.cli``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import httpx
import pytest

from rolloutlog.api.cli import cli as command_tree
from rolloutlog.api.cli import main
from rolloutlog.api.cli._main import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
)
from tests import factories as f
from tests._services import ROOT
from tests.api.conftest import TOKENS, bearer, wire
from tests.api.test_e2e import Server

CLI = (sys.executable, "-m", "rolloutlog.api.cli")
#: What every error line looks like: ``rolloutlog COMMAND…: CODE: message``.
ERROR_LINE = r"^rolloutlog( [a-z-]+)*: [a-z_]+: \S"


@dataclass
class Done:
    status: int
    out: str
    err: str

    def lines(self) -> list[str]:
        return self.out.splitlines()

    def json_lines(self) -> list[dict[str, Any]]:
        values = [json.loads(line) for line in self.lines()]
        assert all(isinstance(v, dict) for v in values), self.out
        return values


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("cli")
    tokens = root / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    running = Server(root / "data", tokens)
    running.start()
    try:
        yield running
    finally:
        assert running.stop() == 0


Cli = Callable[..., Done]


@pytest.fixture
def cli(server: Server, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    """``main(argv)`` in this process with the server's URL and a token of ``role``."""
    monkeypatch.setenv("ROLLOUTLOG_URL", server.url)
    monkeypatch.delenv("ROLLOUTLOG_TOKEN_FILE", raising=False)

    def run(*args: str, role: str | None = "admin") -> Done:
        if role is None:
            monkeypatch.delenv("ROLLOUTLOG_TOKEN", raising=False)
        else:
            monkeypatch.setenv("ROLLOUTLOG_TOKEN", TOKENS[role])
        capsys.readouterr()
        status = main(list(args))
        captured = capsys.readouterr()
        return Done(status, captured.out, captured.err)

    return run


def process(server: Server | None, *args: str, **env: str) -> Done:
    """The command as its own process (``ROLLOUTLOG_URL`` at the server, admin's token)."""
    environ = {**os.environ, **env}
    if server is not None:
        environ.setdefault("ROLLOUTLOG_URL", server.url)
        environ.setdefault("ROLLOUTLOG_TOKEN", TOKENS["admin"])
    done = subprocess.run(
        [*CLI, *args], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=60
    )
    return Done(done.returncode, done.stdout, done.stderr)


def post(server: Server, path: str, role: str, body: Any) -> httpx.Response:
    response = httpx.post(server.url + path, json=body, headers=bearer(role), timeout=30)
    assert response.status_code < 300, response.text
    return response


def seed(server: Server, run: str, *episodes: str) -> None:
    """A run with an environment and a live episode each (started, one boundary)."""
    post(server, "/v1/runs", "trainer", {"run": run, "partitions": 2})
    post(
        server,
        f"/v1/runs/{run}/participants",
        "participant",
        {"id": "env-0", "kind": "environment"},
    )
    events = [e for ep in episodes for e in (f.started(ep), f.boundary(ep, "seed", {"turn": 1}))]
    post(server, f"/v1/runs/{run}/events", "participant", wire(*events))


def test_runs_create_show_list_and_delete(cli: Cli) -> None:
    created = cli("runs", "create", "cli-runs", "--partitions", "3")
    assert (created.status, created.out) == (0, "run cli-runs: 3 partitions\n"), created.err
    again = cli("runs", "create", "cli-runs", "--partitions", "3", "--json")
    assert again.json_lines() == [{"run": "cli-runs", "partitions": 3}]
    conflict = cli("runs", "create", "cli-runs", "--partitions", "5")
    assert conflict.status == EXIT_REFUSED
    assert conflict.err.startswith("rolloutlog runs create: run_exists: "), conflict.err

    listed = cli("runs")  # the group's default: list
    header, *rows = listed.lines()
    assert header.split()[:3] == ["RUN", "PARTITIONS", "EPOCH"]
    assert ["cli-runs", "3"] in [row.split()[:2] for row in rows]
    assert cli("runs", "list").out == listed.out
    shown = cli("runs", "show", "cli-runs")
    assert shown.lines()[0] == "run cli-runs"
    assert any(line.split() == ["health", "ok"] for line in shown.lines()), shown.out
    assert cli("runs", "show", "cli-runs", "--json").json_lines()[0]["partitions"] == 3

    deleted = cli("runs", "delete", "cli-runs")
    assert (deleted.status, deleted.out) == (0, "deleted run cli-runs\n")
    gone = cli("runs", "show", "cli-runs")
    assert gone.status == EXIT_REFUSED
    assert gone.err.startswith("rolloutlog runs show: unknown_run: "), gone.err


def test_checkpoints_restores_and_episodes(server: Server, cli: Cli) -> None:
    seed(server, "cli", "a", "b")

    no_controller = cli("checkpoint", "cli")
    assert no_controller.status == EXIT_REFUSED
    assert "invalid_request: " in no_controller.err and "--take-over" in no_controller.err
    both = cli("checkpoint", "cli", "--take-over", "--epoch", "2")
    assert both.status == EXIT_USAGE
    assert both.err.startswith("rolloutlog checkpoint: usage: --take-over and --epoch exclude")

    taken = cli("checkpoint", "cli", "--take-over", "--json")
    assert taken.status == 0, taken.err
    [checkpoint] = taken.json_lines()
    assert (checkpoint["status"], checkpoint["counts"]["continue"]) == ("committed", 2)
    again = cli("checkpoint", "cli")  # as the current controller
    assert again.status == 0, again.err
    assert again.lines()[0] == "checkpoint 2: committed"

    listed = cli("checkpoints", "cli")
    assert [line.split()[:2] for line in listed.lines()[1:]] == [
        ["2", "committed"],
        ["1", "committed"],
    ]
    assert cli("checkpoints", "cli", "latest").lines()[0] == "checkpoint 2: committed"
    assert cli("checkpoints", "cli", "1", "--json").json_lines()[0]["checkpoint_id"] == 1
    assert cli("checkpoints", "cli", "--status", "aborted").out == "(no checkpoints)\n"
    manifest = cli("checkpoints", "cli", "2", "--manifest")
    assert [row.split()[:3] for row in manifest.lines()[1:]] == [
        ["a", "continue", "0"],
        ["b", "continue", "0"],
    ], manifest.out
    entries = cli("checkpoints", "cli", "latest", "--manifest", "--json").json_lines()
    assert sorted(e["episode"] for e in entries) == ["a", "b"]
    assert cli("checkpoints", "cli", "--manifest").status == EXIT_USAGE
    stats = cli("runs", "show", "cli", "--stats")
    assert any(line.split()[0] == "events.log_records" for line in stats.lines()), stats.out
    assert "stats" in cli("runs", "show", "cli", "--stats", "--json").json_lines()[0]

    restored = cli("restore", "cli", "--exclude", "b", "--episodes")
    assert restored.status == 0, restored.err
    assert restored.lines()[0] == "restore 1 from checkpoint 2"
    fates = {
        row[0]: row[1:3] for row in map(str.split, restored.lines()) if row[:1] in (["a"], ["b"])
    }
    assert fates["a"] == ["continue", "0->1"] and fates["b"][0] == "excluded", restored.out

    [summary] = cli("restores", "cli", "--json").json_lines()
    assert (summary["restore_id"], summary["counts"]["excluded"]) == (1, 1)
    assert cli("restores", "cli").lines()[1].split()[:2] == ["1", "2"]
    [one] = cli("restores", "cli", "1", "--json").json_lines()
    assert sorted(e["episode"] for e in one["episodes"]) == ["a", "b"]
    assert cli("restores", "cli", "1").lines()[0] == "restore 1 from checkpoint 2"

    episodes = cli("episodes", "cli", "--json").json_lines()
    assert {e["episode"]: e["capture_key"] for e in episodes}["a"] == "a-a1"
    history = cli("episode", "cli", "a")
    assert history.status == 0, history.err
    assert history.lines()[0].startswith("episode a of run cli: ")
    attempts = history.out.split("attempts\n")[1].splitlines()[1:3]
    assert [row.split()[:2] for row in attempts] == [["0", "a"], ["1", "a-a1"]]
    [as_json] = cli("episode", "cli", "a", "--json").json_lines()
    assert [a["capture_key"] for a in as_json["attempts"]] == ["a", "a-a1"]

    forbidden = cli("restore", "cli", role="analyst")
    assert forbidden.status == EXIT_REFUSED
    assert forbidden.err.startswith("rolloutlog restore: forbidden: "), forbidden.err


def test_no_wait_returns_at_once_with_the_checkpoint_pending(server: Server, cli: Cli) -> None:
    seed(server, "cli-wait", "w")
    # A wait step left open: the checkpoint stays pending until its boundary arrives.
    post(
        server,
        "/v1/runs/cli-wait/events",
        "participant",
        wire(f.step_started("w", "close", mode="wait")),
    )
    started = time.monotonic()
    pending = cli(
        "checkpoint", "cli-wait", "--take-over", "--no-wait", "--deadline", "60", "--json"
    )
    assert time.monotonic() - started < 15  # not the 60 s deadline
    assert pending.status == 0, pending.err
    [body] = pending.json_lines()
    assert body["status"] == "pending"
    busy = cli("checkpoint", "cli-wait")
    assert busy.status == EXIT_REFUSED
    assert busy.err.startswith("rolloutlog checkpoint: checkpoint_in_progress: "), busy.err

    post(server, "/v1/runs/cli-wait/events", "participant", wire(f.boundary("w", "close")))
    deadline = time.monotonic() + 30
    while cli("checkpoints", "cli-wait", str(body["checkpoint_id"])).lines()[0].endswith("pending"):
        assert time.monotonic() < deadline, "the checkpoint never committed"
        time.sleep(0.2)
    assert cli("checkpoints", "cli-wait", "latest").lines()[0] == (
        f"checkpoint {body['checkpoint_id']}: committed"
    )


def test_ctrl_c_ends_a_waiting_command_with_130(server: Server) -> None:
    seed(server, "cli-int", "i")
    post(
        server,
        "/v1/runs/cli-int/events",
        "participant",
        wire(f.step_started("i", "close", mode="wait")),
    )
    environ = {**os.environ, "ROLLOUTLOG_URL": server.url, "ROLLOUTLOG_TOKEN": TOKENS["admin"]}
    proc = subprocess.Popen(
        [*CLI, "checkpoint", "cli-int", "--take-over", "--deadline", "60"],
        cwd=ROOT,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As a terminal's foreground job starts it: a shell's background job (pytest started
        # with `&`) would hand the CLI an ignored SIGINT, which it keeps.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 30
    while not httpx.get(
        f"{server.url}/v1/runs/cli-int/checkpoints", headers=bearer("analyst")
    ).json()["checkpoints"]:
        assert time.monotonic() < deadline and proc.poll() is None, "the checkpoint never began"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # while it waits for the checkpoint
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED
    assert [line for line in err.splitlines() if line] == [
        "rolloutlog: interrupted: stopped before it finished"
    ], err
    assert out == ""
    # The checkpoint goes on without its client: close the wait step so that it commits.
    post(server, "/v1/runs/cli-int/events", "participant", wire(f.boundary("i", "close")))


def test_every_listing_prints_json_lines(server: Server, cli: Cli) -> None:
    seed(server, "cli-json", *(f"e{i}" for i in range(5)))
    cli("checkpoint", "cli-json", "--take-over")
    cli("restore", "cli-json")
    listings = {
        ("runs",): None,
        ("checkpoints", "cli-json"): 1,
        ("restores", "cli-json"): 1,
        ("episodes", "cli-json"): 5,
    }
    for args, count in listings.items():
        done = cli(*args, "--json")
        assert done.status == 0, (args, done.err)
        values = done.json_lines()  # one object per line, and nothing else
        assert count is None or len(values) == count, (args, done.out)
    assert cli("restores", "cli-json", "--limit", "1", "--json").out.count("\n") == 1
    # An empty listing prints nothing at all (no "[]", no header).
    post(server, "/v1/runs", "trainer", {"run": "cli-empty"})
    for args in (
        ("checkpoints", "cli-empty"),
        ("restores", "cli-empty"),
        ("episodes", "cli-empty"),
    ):
        assert cli(*args, "--json").out == "", args


ERROR_CASES: list[tuple[tuple[str, ...], int, str]] = [
    (("restore", "cli-errors", "--checkpoint", "abc"), EXIT_USAGE, "usage"),
    (("restore", "cli-errors", "--exclude-file", "nofile.txt"), EXIT_USAGE, "usage"),
    (("checkpoints", "cli-errors", "--limit", "abc"), EXIT_USAGE, "usage"),
    (("checkpoints", "cli-errors", "--limit", "0"), EXIT_USAGE, "usage"),
    (("checkpoints", "cli-errors", "abc"), EXIT_USAGE, "usage"),
    (("episodes", "cli-errors", "--status", "sleeping"), EXIT_USAGE, "usage"),
    (("no-such-command",), EXIT_USAGE, "usage"),
    (("runs", "--url", "localhost:8750"), EXIT_USAGE, "usage"),
    (("checkpoints", "no-such-run"), EXIT_REFUSED, "unknown_run"),
    (("checkpoints", "cli-errors", "99"), EXIT_REFUSED, "unknown_checkpoint"),
    (("restores", "cli-errors", "7"), EXIT_REFUSED, "unknown_restore"),
    (("episode", "cli-errors", "nobody"), EXIT_REFUSED, "unknown_episode"),
    (("runs", "--url", "http://127.0.0.1:1"), EXIT_UNREACHABLE, "unreachable"),
]


def _one_error_line(done: Done, status: int, code: str) -> None:
    assert done.status == status, done.err
    lines = done.err.splitlines()
    assert len(lines) == 1, done.err
    assert f": {code}: " in lines[0] and re.match(ERROR_LINE, lines[0]), lines[0]
    assert "Traceback" not in done.err and done.out == ""


def test_errors_are_one_line_with_their_code_and_exit_status(
    server: Server, cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(server, "cli-errors", "x")
    monkeypatch.chdir(tmp_path)  # where nofile.txt is not
    for args, status, code in ERROR_CASES:
        try:
            _one_error_line(cli(*args), status, code)
        except AssertionError as e:
            raise AssertionError(f"{args}: {e}") from e
    # The same as whole processes: the exit status, and no traceback from the interpreter.
    for args, status, code in [ERROR_CASES[1], ERROR_CASES[2], ERROR_CASES[-2], ERROR_CASES[-1]]:
        _one_error_line(process(server, *args), status, code)
    monkeypatch.setenv("ROLLOUTLOG_TOKEN_FILE", str(tmp_path / "none"))
    bad_token = cli("runs", role=None)
    assert bad_token.status == EXIT_USAGE
    assert bad_token.err.startswith("rolloutlog: invalid_configuration: ROLLOUTLOG_TOKEN_FILE: ")
    wrong = cli("runs", "--token", "not-a-token-of-this-service")
    assert (wrong.status, wrong.err.split(": ")[1]) == (EXIT_REFUSED, "unauthorized")


def test_the_token_comes_from_the_flag_the_variable_or_its_file(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = tmp_path / "token"
    token.write_text(TOKENS["analyst"] + "\n")  # as a secrets file holds it
    monkeypatch.setenv("ROLLOUTLOG_TOKEN_FILE", str(token))
    assert cli("runs", role=None).status == 0
    # The variable wins over its file (a participant may not list runs), the flag over both.
    denied = cli("runs", role="participant")
    assert (denied.status, denied.err.split(": ")[1]) == (EXIT_REFUSED, "forbidden")
    assert cli("runs", "--token", TOKENS["analyst"], role="participant").status == 0


@pytest.mark.parametrize("json_flag", [(), ("--json",)])
def test_a_closed_pipe_ends_quietly(server: Server, json_flag: tuple[str, ...]) -> None:
    run = f"cli-pipe-{len(json_flag)}"
    episodes = [f"piped-{i:05d}" for i in range(2000)]  # far more than a pipe's buffer holds
    seed(server, run, *episodes[:1])
    post(server, f"/v1/runs/{run}/events", "participant", wire(*map(f.started, episodes[1:])))
    deadline = time.monotonic() + 30
    while (
        len(
            httpx.get(
                f"{server.url}/v1/runs/{run}/episodes",
                headers={**bearer("analyst"), "Accept": "application/x-ndjson"},
            ).text.splitlines()
        )
        < 2000
    ):
        assert time.monotonic() < deadline, "the projector never tracked the episodes"
        time.sleep(0.2)
    environ = {**os.environ, "ROLLOUTLOG_URL": server.url, "ROLLOUTLOG_TOKEN": TOKENS["admin"]}
    proc = subprocess.Popen(
        [*CLI, "episodes", run, *json_flag],
        cwd=ROOT,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()  # then go away, as `| head -1` does
    proc.stdout.close()
    assert proc.wait(timeout=60) == EXIT_BROKEN_PIPE
    assert first and proc.stderr.read() == b""
    proc.stderr.close()


def test_version_and_shell_completion(server: Server) -> None:
    from rolloutlog import __version__

    assert process(None, "--version").out == f"rolloutlog {__version__}\n"
    for shell in ("bash", "zsh", "fish"):
        script = process(None, "completion", shell)
        assert script.status == 0 and "_ROLLOUTLOG_COMPLETE" in script.out, shell
    seed(server, "cli-complete", "c")

    def complete(words: str) -> list[str]:
        done = process(
            server,
            *(),
            _ROLLOUTLOG_COMPLETE="bash_complete",
            COMP_WORDS=words,
            COMP_CWORD=str(len(words.split(" ")) - 1),
        )
        assert done.status == 0, done.err
        return [line.split(",", 1)[1] for line in done.lines()]

    assert "runs" in complete("rolloutlog ru")
    assert complete("rolloutlog checkpoints cli-comp") == ["cli-complete"]
    assert "--no-wait" in complete("rolloutlog checkpoint cli-complete --no")


def _commands(
    group: click.Group, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    for name, command in group.commands.items():
        yield (*path, name), command
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))


def test_help_on_every_command_shows_help_on_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    commands = list(_commands(command_tree))
    assert {path[0] for path, _ in commands} <= set(top.split())
    for path, command in commands:
        assert main([*path, "--help"]) == 0, path
        text = capsys.readouterr().out
        assert command.help, path
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help, (path, param.opts)
                assert all(opt in text for opt in param.opts), (path, param.opts)


def test_serve_has_a_flag_for_every_setting() -> None:
    from rolloutlog.api._config import ServeConfig

    serve = command_tree.commands["serve"]
    flags = {p.name for p in serve.params if isinstance(p, click.Option) and p.name != "help"}
    assert flags == set(ServeConfig.model_fields)


def test_results_and_their_acknowledgement(server: Server, cli: Cli) -> None:
    seed(server, "cli-results", "r1", "r2", "r3")
    assert cli("checkpoint", "cli-results", "--take-over").status == 0  # all three live
    finished = [
        f.finished("r1", reward=0.5, result={"score": 1}),
        f.finished("r2", reward=2.0, result="done"),
    ]
    post(server, "/v1/runs/cli-results/events", "participant", wire(*finished))

    listed = cli("results", "cli-results")  # the group's default: list
    assert listed.status == 0, listed.err
    header, *rows = listed.lines()
    assert header.split()[:4] == ["EPISODE", "ATTEMPT", "CAPTURE_KEY", "REWARD"]
    assert [row.split()[:4] for row in rows] == [["r1", "0", "r1", "0.5"], ["r2", "0", "r2", "2"]]
    lines = cli("results", "cli-results", "--json").json_lines()
    assert [(r["episode"], r["result"], r["acknowledged"]) for r in lines] == [
        ("r1", {"score": 1}, False),
        ("r2", "done", False),
    ]
    only = cli("results", "cli-results", "--episode", "r2", "--json").json_lines()
    assert [r["episode"] for r in only] == ["r2"]
    since = cli("results", "cli-results", "--since-checkpoint", "1", "--json").json_lines()
    assert [r["episode"] for r in since] == ["r1", "r2"]  # both finished past its cut

    acked = cli("results", "ack", "cli-results", "r1", "r3")
    assert (acked.status, acked.out) == (0, "acknowledged 1 of 2 results\n"), acked.err
    again = cli("results", "ack", "cli-results", "r1", "--json").json_lines()
    assert again == [{"run": "cli-results", "acknowledged": 0}]  # idempotent
    left = cli("results", "list", "cli-results", "--unacknowledged", "--json").json_lines()
    assert [r["episode"] for r in left] == ["r2"]

    [restored] = cli("restore", "cli-results", "--exclude-results", "--json").json_lines()
    assert restored["counts"]["excluded"] == 2  # r1 and r2: their results are held
    assert restored["unacknowledged_results"] == 1  # r2's

    missing = cli("results", "cli-results", "--since-checkpoint", "9")
    assert missing.status == EXIT_REFUSED and ": unknown_checkpoint: " in missing.err
    usage = cli("results", "ack", "cli-results")
    assert usage.status == EXIT_USAGE and "Missing argument" in usage.err
    forbidden = cli("results", "ack", "cli-results", "r2", role="analyst")
    assert forbidden.status == EXIT_REFUSED and ": forbidden: " in forbidden.err


def test_participants_quarantine_projector_and_projection(server: Server, cli: Cli) -> None:
    seed(server, "cli-analyst", "p1", "p2")
    assert cli("checkpoint", "cli-analyst", "--take-over").status == 0
    assert cli("restore", "cli-analyst").status == 0

    listed = cli("participants", "cli-analyst", role="analyst")
    assert listed.status == 0, listed.err
    header, *rows = listed.lines()
    assert header.split()[:3] == ["ID", "KIND", "EPOCH"]
    assert [row.split()[:3] for row in rows] == [["env-0", "environment", "1"]]
    [one] = cli("participants", "cli-analyst", "--json").json_lines()
    assert (one["id"], one["kind"], one["epoch"]) == ("env-0", "environment", 1)

    # HTTP appends are validated, so this run has nothing quarantined (the bad records
    # themselves are tests/faults/test_bad_records.py's): an empty listing prints no line.
    assert cli("quarantine", "cli-analyst", role="analyst").out == "(no quarantined records)\n"
    assert cli("quarantine", "cli-analyst", "--after", "0:0", "--json").out == ""

    lag = cli("projector", "cli-analyst", role="analyst")
    assert lag.status == 0, lag.err
    [as_json] = cli("projector", "cli-analyst", "--json").json_lines()
    ends = [p["end_offset"] for p in as_json["partitions"]]
    assert len(ends) == 2 and as_json["log_records"] == sum(ends) >= 4  # the 4 seeded events
    assert as_json["lag"] == 0, as_json  # a committed checkpoint: the projector reached its markers
    assert lag.lines()[0] == f"projector of run cli-analyst: 0 records behind of {sum(ends)}"
    assert [row.split()[:2] for row in lag.lines()[2:]] == [
        ["0", str(ends[0])],
        ["1", str(ends[1])],
    ]

    shown = cli("projection", "cli-analyst", "p1", "--restore", "latest", role="participant")
    assert shown.status == 0, shown.err
    assert shown.lines()[0] == "episode p1: live, attempt 1, capture key p1-a1", shown.out
    boundary = shown.out.split("boundaries\n")[1].splitlines()[1]
    assert boundary.split()[:2] == ["environment", "seed"], shown.out
    [at_cut] = cli("projection", "cli-analyst", "p2", "--checkpoint", "1", "--json").json_lines()
    assert (at_cut["episode"], at_cut["attempt"]) == ("p2", 0)
    assert at_cut["boundaries"]["environment"]["stage"] == "seed"

    neither = cli("projection", "cli-analyst", "p1")
    assert neither.status == EXIT_USAGE and "exactly one of --restore" in neither.err
    both = cli("projection", "cli-analyst", "p1", "--restore", "1", "--checkpoint", "1")
    assert both.status == EXIT_USAGE
    bad_after = cli("quarantine", "cli-analyst", "--after", "nowhere")
    assert bad_after.status == EXIT_REFUSED and ": invalid_request: " in bad_after.err
    for args in (
        ("participants", "no-such-run"),
        ("quarantine", "no-such-run"),
        ("projector", "no-such-run"),
        ("projection", "no-such-run", "p1", "--restore", "latest"),
    ):
        try:
            _one_error_line(cli(*args), EXIT_REFUSED, "unknown_run")
        except AssertionError as e:
            raise AssertionError(f"{args}: {e}") from e
    _one_error_line(
        cli("projection", "cli-analyst", "p1", "--checkpoint", "9"),
        EXIT_REFUSED,
        "unknown_checkpoint",
    )
