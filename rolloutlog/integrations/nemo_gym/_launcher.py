"""Start a NeMo Gym's servers from its config without Ray, rolloutlog attached.

``ng_run`` starts every server as ``python app.py`` (whose ``X.run_webserver()`` starts or joins a
Ray cluster: ``initialize_ray()`` runs unconditionally) plus a head server, after building a uv
venv per server. None of the servers rolloutlog attaches to needs Ray, so the launcher does
what ``run_webserver`` does without it, one process group per server (a crash test can SIGKILL
each), all in the current venv:

- ``resolve_config``: NeMo Gym's own parser (config paths, ``${...}``, hosts and free ports);
- ``build_app``: the server class (``rolloutlog.server_class``, else the one the entrypoint's
  ``if __name__ == "__main__"`` block runs), constructed as ``run_webserver`` does, its
  ``setup_webserver()`` app with NeMo Gym's liveness and exception middleware, then rolloutlog
  attached by kind: resources servers through ``attach_resources``; an agent or model server
  whose class has ``rolloutlog_app(app, settings)`` (the integration's subclasses) through it;
  others as they are;
- ``serve``: one server in this process (``NEMO_GYM_CONFIG_DICT``/``NEMO_GYM_CONFIG_PATH``, as
  ``ng_run`` passes them), on uvicorn;
- ``Launcher``: NeMo Gym's head server in a thread (``ng_status``, ``ng_collect_rollouts`` and
  the collector find the servers through it) and ``serve`` per server in its own session.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rolloutlog.integrations.nemo_gym._config import (
    GymSettings,
    load_object,
    server_dict,
    server_instances,
)
from rolloutlog.integrations.nemo_gym._resources import attach_resources
from rolloutlog.participants.sim import die_with_parent

__all__ = [
    "CONFIG_DICT_ENV",
    "CONFIG_PATH_ENV",
    "Launcher",
    "ServerProcess",
    "build_app",
    "plain_config",
    "resolve_config",
    "serve",
    "server_class",
]

#: How ``ng_run`` hands a server the resolved config and its own instance name.
CONFIG_DICT_ENV = "NEMO_GYM_CONFIG_DICT"
CONFIG_PATH_ENV = "NEMO_GYM_CONFIG_PATH"


def resolve_config(config_paths: Sequence[str], overrides: Sequence[str] = ()) -> Any:
    """The global config dict NeMo Gym would resolve for ``+config_paths=[...]`` plus
    ``key=value`` overrides (a resolved config resolves to itself: ports stay)."""
    from nemo_gym.global_config import GlobalConfigDictParser  # type: ignore[import-not-found,unused-ignore]
    from omegaconf import OmegaConf  # type: ignore[import-not-found,unused-ignore]

    initial = OmegaConf.merge(
        OmegaConf.create({"config_paths": list(config_paths)}),
        OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]),
    )
    return GlobalConfigDictParser().parse_no_environment(initial_global_config_dict=initial)


def plain_config(config: Any) -> dict[str, Any]:
    """A resolved config as plain dicts and lists."""
    from omegaconf import DictConfig, OmegaConf  # type: ignore[import-not-found,unused-ignore]

    if isinstance(config, DictConfig):
        plain: dict[str, Any] = OmegaConf.to_container(config, resolve=True)
        return plain
    return dict(config)


def _entrypoint_class(path: Path) -> str:
    """The class whose ``run_webserver()`` the entrypoint's ``__main__`` block calls."""
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.If) or "__main__" not in ast.unparse(node.test):
            continue
        for inner in ast.walk(node):
            if (
                isinstance(inner, ast.Call)
                and isinstance(inner.func, ast.Attribute)
                and inner.func.attr == "run_webserver"
                and isinstance(inner.func.value, ast.Name)
            ):
                return inner.func.value.id
    raise ValueError(f"{path}: no `if __name__ == '__main__': X.run_webserver()` block")


def _server_dir(server_type: str, impl: str) -> Path:
    """Where NeMo Gym finds a server's code: the working directory first, then its install."""
    from nemo_gym import PARENT_DIR  # type: ignore[import-not-found,unused-ignore]

    local = Path.cwd() / server_type / impl
    if (local / "requirements.txt").exists() or (local / "pyproject.toml").exists():
        return local
    return Path(PARENT_DIR) / server_type / impl


def server_class(config: Mapping[str, Any], name: str) -> type:
    """The class server instance ``name`` runs (``rolloutlog.server_class`` overrides it)."""
    inner = server_dict(config, name)
    override = (inner.get("rolloutlog") or {}).get("server_class")
    if override:
        cls: type = load_object(str(override))
        return cls
    server_type, impl = server_instances(config)[name]
    directory = _server_dir(server_type, impl)
    entrypoint = Path(str(inner["entrypoint"]))
    class_name = _entrypoint_class(directory / entrypoint)
    module = ".".join((*entrypoint.with_suffix("").parts,))
    if directory.parent.parent != Path.cwd():  # installed: an importable package path
        module = f"{server_type}.{impl}.{module}"
    else:
        sys.path.insert(0, str(directory))
    imported = __import__(module, fromlist=[class_name])
    found: type = getattr(imported, class_name)
    return found


def build_app(global_config: Any, name: str) -> tuple[Any, str, int]:
    """Server instance ``name`` as ``run_webserver`` builds it, minus Ray, with rolloutlog
    attached; returns (ASGI app, host, port). ``global_config`` must be the dict NeMo Gym's
    ``get_global_config_dict()`` returns in this process (``serve`` sets it up)."""
    from nemo_gym.server_utils import ServerClient  # type: ignore[import-not-found,unused-ignore]

    plain = plain_config(global_config)
    cls: Any = server_class(plain, name)
    server_config = cls.load_config_from_global_config()
    if (server_config.num_workers or 1) > 1:
        print(
            f"{name}: num_workers={server_config.num_workers}: the launcher serves one worker",
            file=sys.stderr,
        )
    client = ServerClient(
        head_server_config=ServerClient.load_head_server_config(),
        global_config_dict=global_config,
    )
    server = cls(config=server_config, server_client=client)
    app = server.setup_webserver()
    server.setup_liveness(app)
    server.set_ulimit()
    server.setup_exception_middleware(app)
    settings = GymSettings.from_config(plain, name)
    served: Any = app
    if settings is not None:
        if settings.kind == "resources_servers":
            served = attach_resources(server, app, settings)
        elif hasattr(server, "rolloutlog_app"):
            served = server.rolloutlog_app(app, settings)
    return served, str(server_config.host), int(server_config.port)


def serve(name: str | None = None) -> None:
    """Run one server in this process, as ``ng_run``'s child would (its config from
    ``NEMO_GYM_CONFIG_DICT``, its name from ``NEMO_GYM_CONFIG_PATH`` unless given)."""
    import uvicorn
    from nemo_gym.global_config import get_global_config_dict  # type: ignore[import-not-found,unused-ignore]

    if name is not None:
        os.environ[CONFIG_PATH_ENV] = name
    name = os.environ[CONFIG_PATH_ENV]
    app, host, port = build_app(get_global_config_dict(), name)
    # as run_webserver: a short graceful shutdown (requests in flight are cancelled), and a
    # keep-alive longer than NeMo Gym's clients' (15 s)
    uvicorn.run(
        app,
        host=host,
        port=port,
        timeout_graceful_shutdown=1,
        timeout_keep_alive=30,
        log_level="warning",
    )


@dataclass
class ServerProcess:
    """One NeMo Gym server process, in its own process group (session)."""

    name: str
    kind: str
    url: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)


class Launcher:
    """Starts every server of a resolved NeMo Gym config (``resolve_config``) without Ray::

        launcher = Launcher(resolve_config(["my_env.yaml"]), log_dir=Path("logs"))
        launcher.start()           # head server + one process group per server, until ready
        launcher.run_forever()     # until SIGTERM/SIGINT or a server exits; stops the rest

    ``state_path``: once every server answers, a JSON file with the launcher's pid, the head
    server's URL and each server's kind, URL and pid (= its process group), for the tools and
    tests that find or kill them.
    """

    def __init__(
        self,
        global_config: Any,
        *,
        only: Iterable[str] | None = None,
        log_dir: Path | None = None,
        state_path: Path | None = None,
        head: bool = True,
        startup_timeout_s: float = 180.0,
    ) -> None:
        from omegaconf import OmegaConf  # type: ignore[import-not-found,unused-ignore]

        self.global_config = global_config
        self.config_yaml: str = OmegaConf.to_yaml(global_config)
        self.plain = plain_config(global_config)
        names = server_instances(self.plain)
        chosen = list(names) if only is None else list(only)
        self.servers: dict[str, ServerProcess] = {}
        for name in chosen:
            inner = server_dict(self.plain, name)
            url = f"http://{inner['host']}:{inner['port']}"
            self.servers[name] = ServerProcess(name, names[name][0], url)
        head_server = self.plain["head_server"]
        self.head_url = f"http://{head_server['host']}:{head_server['port']}"
        self.log_dir = log_dir
        self.state_path = state_path
        self.head = head
        self.startup_timeout_s = startup_timeout_s
        self._head_server: Any = None
        self._head_thread: Any = None

    def start(self) -> None:
        """Start the head server and every server, and wait until each answers ``GET /``."""
        os.environ[CONFIG_DICT_ENV] = self.config_yaml
        try:
            if self.head:
                from nemo_gym.server_utils import HeadServer  # type: ignore[import-not-found,unused-ignore]

                self._head_server, self._head_thread, _ = HeadServer.run_webserver()
            for server in self.servers.values():
                self._spawn(server)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        if self.state_path is not None:
            self._write_state(self.state_path)

    def _spawn(self, server: ServerProcess) -> None:
        env = {**os.environ, CONFIG_DICT_ENV: self.config_yaml, CONFIG_PATH_ENV: server.name}
        command = [sys.executable, "-m", "rolloutlog.integrations.nemo_gym", "serve", server.name]
        output: Any = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            output = open(self.log_dir / f"{server.name}.log", "ab")  # noqa: SIM115
        try:
            server.proc = subprocess.Popen(
                command,
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        finally:
            if output is not None:
                output.close()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        waiting = dict(self.servers)
        with httpx.Client(timeout=2.0) as client:
            while waiting:
                for name, server in list(waiting.items()):
                    if not server.alive:
                        raise RuntimeError(f"NeMo Gym server {name} exited while starting")
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(server.url + "/").status_code == 200:
                            del waiting[name]
                if waiting and time.monotonic() > deadline:
                    raise TimeoutError(f"NeMo Gym servers not ready in time: {sorted(waiting)}")
                time.sleep(0.1)

    def _write_state(self, path: Path) -> None:
        state = {
            "pid": os.getpid(),
            "head": self.head_url if self.head else None,
            "servers": {
                name: {"kind": s.kind, "url": s.url, "pid": s.proc.pid if s.proc else None}
                for name, s in self.servers.items()
            },
        }
        partial = path.with_suffix(path.suffix + ".partial")
        partial.write_text(json.dumps(state, indent=2))
        partial.replace(path)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every server's group (SIGKILL after ``timeout_s``); stop the head server."""
        for server in self.servers.values():
            server.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for server in self.servers.values():
            if server.proc is None:
                continue
            try:
                server.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                server.signal(signal.SIGKILL)
                server.proc.wait()
        if self._head_server is not None:
            self._head_server.should_exit = True
            self._head_thread.join(timeout_s)
            self._head_server = None

    def run_forever(self) -> int:
        """Until SIGTERM/SIGINT (exit 0) or a server exits (exit 1); then stop the rest."""
        stopping: list[int] = []

        def request_stop(signum: int, _frame: Any) -> None:
            stopping.append(signum)

        previous = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while not stopping:
                dead = [name for name, server in self.servers.items() if not server.alive]
                if dead:
                    print(f"NeMo Gym server(s) exited: {', '.join(dead)}", file=sys.stderr)
                    return 1
                time.sleep(0.2)
            return 0
        finally:
            self.stop()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
