"""The ``rolloutlog`` command: ``serve`` the service, or talk to one.

    rolloutlog serve [--data-dir DIR] [--host H] [--port P] [--log URL] [--catalog URL] …
    rolloutlog runs [list | show RUN | create RUN | fork SOURCE RUN | delete RUN]
    rolloutlog checkpoint RUN [--deadline S] [--no-wait] [--take-over | --epoch N]
    rolloutlog checkpoints RUN [ID|latest] [--status S] [--limit N]
    rolloutlog restore RUN [--checkpoint ID|latest] [--exclude EPISODE]… [--episodes]
    rolloutlog restores RUN [ID]
    rolloutlog episodes RUN [--status S]
    rolloutlog episode RUN EPISODE
    rolloutlog results RUN [--unacknowledged] [--since-checkpoint ID] [--episode EPISODE]…
    rolloutlog results ack RUN EPISODE…
    rolloutlog participants RUN
    rolloutlog quarantine RUN [--after PARTITION:OFFSET] [--limit N]
    rolloutlog projector RUN
    rolloutlog projection RUN EPISODE (--restore ID|latest | --checkpoint ID)
    rolloutlog completion bash|zsh|fish
    rolloutlog --version

Exit codes, the ``--json`` convention (JSON Lines) and the environment variables are in
docs/api.md, "CLI clients". ``python -m rolloutlog.api.cli`` runs it too. It lives in the ``api`` package
because ``serve`` configures and starts the app from that package's private modules; the
client commands import nothing of the server's stack, so that the command starts fast.
"""

from __future__ import annotations

from rolloutlog.api.cli import _forks  # noqa: F401 - registers ``runs fork``
from rolloutlog.api.cli._analyst import ANALYST_COMMANDS
from rolloutlog.api.cli._checkpoints import checkpoint, checkpoints
from rolloutlog.api.cli._episodes import episode, episodes
from rolloutlog.api.cli._main import cli, main
from rolloutlog.api.cli._restores import restore, restores
from rolloutlog.api.cli._results import results
from rolloutlog.api.cli._runs import runs
from rolloutlog.api.cli._serve import GC_THRESHOLDS, serve

__all__ = ["GC_THRESHOLDS", "cli", "main"]

_CLIENT_COMMANDS = [runs, checkpoint, checkpoints, restore, restores, episodes, episode, results]
for _command in [serve, *_CLIENT_COMMANDS, *ANALYST_COMMANDS]:
    cli.add_command(_command)
