"""The ``rolloutlog`` group, its exit codes, and what every client command shares: ``--url``,
``--token``, ``--json``, the trainer client, and errors printed as ``CODE: message``.

Start-up stays light: the group and its options import click and nothing of the service or of
httpx; each command imports what it needs when it runs. ``rolloutlog --help`` took 0.37 s of
CPU with argparse and the client's stack imported up front, 0.16 s now (medians of 15 runs of
each, paired, on the shared 2-core machine).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.shell_completion import CompletionItem

from rolloutlog import __version__
from rolloutlog.api._env import file_value
from rolloutlog.errors import ConfigurationError, RolloutlogError
from rolloutlog.wire import DEFAULT_URL

if TYPE_CHECKING:
    from rolloutlog.trainer import TrainerClient

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "CheckpointRef",
    "CliError",
    "DefaultGroup",
    "cli",
    "client_command",
    "controller_epoch",
    "controller_options",
    "json_option",
    "main",
    "run_argument",
]

EXIT_OK = 0
#: The service refused the request (its error code is printed), or the operation it ran ended
#: badly (a checkpoint that aborted).
EXIT_REFUSED = 1
#: A mistake on this side: an unknown flag, a bad value, a missing file, bad configuration.
EXIT_USAGE = 2
#: No answer from the service: nothing listens at the URL, or the connection failed.
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130
#: The reader of stdout went away (``| head -1``): 128 + SIGPIPE, as a shell reports it.
EXIT_BROKEN_PIPE = 141

EXIT_CODES_HELP = f"""\b
Exit codes:
  {EXIT_OK}    done
  {EXIT_REFUSED}    the service refused (CODE: message) or the operation failed
  {EXIT_USAGE}    a usage or configuration mistake (bad flag, value or file)
  {EXIT_UNREACHABLE}    the service could not be reached
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
  {EXIT_BROKEN_PIPE}  stdout closed early (e.g. piped into head)
"""

F = TypeVar("F", bound=Callable[..., Any])


class CliError(click.ClickException):
    """Printed as ``rolloutlog COMMAND: CODE: message``; the process exits with ``status``."""

    def __init__(self, code: str, message: str, status: int) -> None:
        super().__init__(message)
        self.code = code
        self.status = status
        ctx = click.get_current_context(silent=True)
        self.command = ctx.command_path if ctx is not None else "rolloutlog"

    @classmethod
    def of(cls, error: RolloutlogError) -> CliError:
        local = isinstance(error, ConfigurationError)
        return cls(error.code, error.message, EXIT_USAGE if local else EXIT_REFUSED)


class DefaultGroup(click.Group):
    """A group whose first argument, unless it names one of its commands, goes to ``default``:
    ``runs`` lists and ``runs delete RUN`` deletes; ``results RUN`` lists and
    ``results ack RUN EP…`` acknowledges. (A run named like a command takes the explicit
    form: ``runs show list``.)"""

    def __init__(self, *args: Any, default: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.default = default

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names):
            args = [self.default, *args]
        return super().parse_args(ctx, args)


class ServiceUrl(click.ParamType[str]):
    name = "URL"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        if not text.startswith(("http://", "https://")):
            self.fail(f"{text!r} is not an http:// or https:// URL", param, ctx)
        return text


class CheckpointRef(click.ParamType[int | str]):
    """A checkpoint id (a positive integer) or ``latest``."""

    name = "ID|latest"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | str:
        if value == "latest" or isinstance(value, int):
            return value  # type: ignore[no-any-return]
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number <= 0:
            self.fail(f"{value!r} is neither a checkpoint id (1, 2, …) nor 'latest'", param, ctx)
        return number


def _complete_runs(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """Run names from the service, for the shell's completion (nothing when it cannot ask)."""
    try:
        from rolloutlog.trainer import TrainerClient

        url = ctx.params.get("url") or os.environ.get("ROLLOUTLOG_URL")
        with TrainerClient(url, token=ctx.params.get("token"), timeout_s=2) as client:
            runs = [str(r["run"]) for r in client.list_runs()]
    except Exception:  # a completion must never break the shell, whatever went wrong
        return []
    return [CompletionItem(run) for run in runs if run.startswith(incomplete)]


def run_argument(f: F) -> F:
    return click.argument("run", shell_complete=_complete_runs)(f)


json_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print JSON Lines: one compact JSON object per line (one per item for listings).",
)


def checkpoint_option(help_text: str) -> Callable[[F], F]:
    """``--checkpoint ID|latest`` (default ``latest``) as ``checkpoint_id``."""
    return click.option(
        "--checkpoint",
        "checkpoint_id",
        type=CheckpointRef(),
        default="latest",
        show_default=True,
        help=help_text,
    )


def limit_option(default: int, help: str, most: int | None = None) -> Callable[[F], F]:
    """A listing's ``--limit``: at most ``most`` when the route caps it."""
    return click.option(
        "--limit",
        type=click.IntRange(1, most),
        default=default,
        show_default=True,
        help=help,
    )


def controller_options(f: Any) -> Any:
    """``--take-over`` or ``--epoch N``: the controller a command acts as (see
    ``controller_epoch``)."""
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


def controller_epoch(client: TrainerClient, run: str, take_over: bool, epoch: int | None) -> int:
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


def client_command(f: Callable[..., int]) -> Callable[..., int]:
    """Give a command ``--url`` and ``--token``, and call it with a ``TrainerClient`` as its
    first argument; the service's refusals and connection failures end it with their code."""

    @functools.wraps(f)
    def call(url: str, token: str | None, **kwargs: Any) -> int:
        import httpx

        from rolloutlog.trainer import TrainerClient

        try:
            with TrainerClient(url, token=token) as client:
                return f(client, **kwargs)
        except RolloutlogError as e:
            raise CliError.of(e) from e
        except httpx.TransportError as e:
            why = str(e) or type(e).__name__
            raise CliError("unreachable", f"cannot reach {url}: {why}", EXIT_UNREACHABLE) from e

    call = click.option(
        "--token",
        envvar="ROLLOUTLOG_TOKEN",
        show_envvar=True,
        default=lambda: file_value("ROLLOUTLOG_TOKEN"),
        help="Bearer token (or a file named by ROLLOUTLOG_TOKEN_FILE).",
    )(call)
    call = click.option(
        "--url",
        type=ServiceUrl(),
        envvar="ROLLOUTLOG_URL",
        show_envvar=True,
        default=DEFAULT_URL,
        show_default=True,
        help="The service's URL.",
    )(call)
    return call


class _ReaderGone(Exception):
    """stdout's reader went away (a ``BrokenPipeError``, which click would turn into exit 1)."""


class _Rolloutlog(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            result = super().invoke(ctx)
            sys.stdout.flush()  # a broken pipe shows here rather than at exit
        except BrokenPipeError as e:
            raise _ReaderGone from e
        return result


@click.group(
    cls=_Rolloutlog,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=EXIT_CODES_HELP,
)
@click.version_option(
    __version__, "--version", prog_name="rolloutlog", message="%(prog)s %(version)s"
)
def cli() -> None:
    """Event-sourced checkpoint log for RL rollouts: run the service (serve), or talk to one.

    Client commands read ROLLOUTLOG_URL and ROLLOUTLOG_TOKEN (or --url, --token); --json
    prints JSON Lines. Shell completion: eval "$(rolloutlog completion bash)".
    """


@cli.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> int:
    """Print the shell completion script for SHELL.

    \b
    bash:  eval "$(rolloutlog completion bash)"   (e.g. in ~/.bashrc)
    zsh:   eval "$(rolloutlog completion zsh)"    (e.g. in ~/.zshrc)
    fish:  rolloutlog completion fish > ~/.config/fish/completions/rolloutlog.fish

    Commands, flags, choices and run names (asked from the service) complete.
    """
    from click.shell_completion import get_completion_class

    found = get_completion_class(shell)
    assert found is not None  # the choice only offers shells click knows
    print(found(cli, {}, "rolloutlog", "_ROLLOUTLOG_COMPLETE").source())
    return EXIT_OK


def _fail(command: str, code: str, message: str) -> None:
    print(f"{command}: {code}: {' '.join(message.split())}", file=sys.stderr)


def _invoke(argv: Sequence[str] | None) -> int:
    try:
        result = cli.main(
            args=None if argv is None else list(argv),
            prog_name="rolloutlog",
            standalone_mode=False,
        )
    except click.exceptions.NoArgsIsHelpError as e:
        print(e.format_message())  # the help: ``rolloutlog`` alone asks what there is
        return EXIT_USAGE
    except click.UsageError as e:
        command = e.ctx.command_path if e.ctx is not None else "rolloutlog"
        _fail(command, "usage", f"{e.format_message()} (see '{command} --help')")
        return EXIT_USAGE
    except CliError as e:
        _fail(e.command, e.code, e.format_message())
        return e.status
    except click.ClickException as e:
        _fail("rolloutlog", "usage", e.format_message())
        return e.exit_code
    except click.Abort:
        _fail("rolloutlog", "interrupted", "stopped before it finished")
        return EXIT_INTERRUPTED
    except RolloutlogError as e:  # e.g. an unreadable ROLLOUTLOG_TOKEN_FILE, read while parsing
        error = CliError.of(e)
        _fail("rolloutlog", error.code, error.format_message())
        return error.status
    return result if isinstance(result, int) else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: the process's) and return its exit code."""
    try:
        status = _invoke(argv)
        sys.stdout.flush()
        return status
    except (_ReaderGone, BrokenPipeError):
        # No traceback, and nothing more to write: not even what is buffered, at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
