"""``rolloutlog runs fork SOURCE RUN``: a fork from the command line, and the lineage that
``runs show`` prints for both runs."""

from __future__ import annotations

from rolloutlog.api.cli._main import EXIT_REFUSED
from tests.api.test_cli import Cli, cli, seed, server  # noqa: F401 - its fixtures
from tests.api.test_e2e import Server


def test_runs_fork_and_the_lineage_runs_show_prints(server: Server, cli: Cli) -> None:  # noqa: F811
    seed(server, "cli-src", "a", "b", "c")
    assert cli("checkpoint", "cli-src", "--take-over").status == 0
    forked = cli(
        "runs", "fork", "cli-src", "cli-fork", "--checkpoint", "latest", "--episodes", "a,b"
    )
    assert forked.status == 0, forked.err
    assert forked.out.startswith("run cli-fork forked from cli-src@1: continue=2 restart=0"), (
        forked.out
    )
    again = cli(
        "runs", "fork", "cli-src", "cli-fork", "--episodes", "a", "--episodes", "b", "--json"
    )
    (line,) = again.json_lines()
    assert line["forked_from"]["run"] == "cli-src" and "counts" not in line
    other = cli("runs", "fork", "cli-src", "cli-fork", "--exclude", "c")
    assert other.status == EXIT_REFUSED
    assert other.err.startswith("rolloutlog runs fork: run_exists: "), other.err

    shown = cli("runs", "show", "cli-fork")
    assert ["forked", "from", "cli-src@1"] in [row.split() for row in shown.lines()], shown.out
    source = cli("runs", "show", "cli-src")
    assert ["fork", "cli-fork", "(from", "checkpoint", "1)"] in [
        row.split() for row in source.lines()
    ], source.out
    restored = cli("restore", "cli-fork", "--take-over", "--json")
    assert restored.status == 0, restored.err
    assert restored.json_lines()[0]["counts"]["continue"] == 2
