"""The launcher: ``rolloutlog serve`` and every simulated participant as real processes."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import httpx

if TYPE_CHECKING:
    from rolloutlog.participants.sim._collector import Collector

__all__ = ["PARTICIPANTS", "Gym", "merge_policy_stats"]

#: The participant processes a Gym runs: name -> (role, participant id).
PARTICIPANTS: dict[str, tuple[str, str]] = {
    "policy": ("policy", "policy-0"),
    "agent": ("agent", "agent-0"),
    "counter": ("resources", "counter-0"),
    "verifier": ("resources", "verifier-0"),
    "restart": ("resources", "restart-0"),
    "sandbox": ("resources", "sandbox-0"),
    "environment": ("environment", "env-0"),
}
_MODES = {"counter": "exported", "verifier": "stateless", "restart": "restart_only"}
_MODES["sandbox"] = "sandbox"  # export-on-checkpoint: state in a SQLite file of its own


def free_port() -> int:
    """A loopback port nothing listens on, for a server started next (by another process).

    Taken below the kernel's ephemeral range: a port the kernel hands out (``bind`` to port 0)
    may be taken by any outgoing connection between this check and the server's own bind (seen as
    ``EADDRINUSE`` with the tests on two workers); outgoing connections never take these."""
    for _ in range(100):
        port = random.randrange(_PORTS_FROM, _EPHEMERAL_LOW)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {_PORTS_FROM}-{_EPHEMERAL_LOW - 1}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_PORTS_FROM = 10_000
_EPHEMERAL_LOW = max(_PORTS_FROM + 1000, _ephemeral_low())


def die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the launcher dies (Linux), so a killed test
    run leaves no server behind (each runs in its own session, out of reach of the terminal)."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class _Process:
    name: str
    port: int
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the process's whole group (it runs in its own session)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)

    def terminate(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


class Gym:
    """A simulated Gym of real processes: the service and six participant servers.

    ::

        async with Gym() as gym:                      # embedded log + SQLite in a temp dir
            async with gym.collector(concurrency=50) as collector:
                report = await collector.run(make_tasks(100))

    - ``Gym(data_dir, log_url="kafka://…", catalog_url="postgresql+asyncpg://…")`` runs the
      distributed deployment; ``participant_transport="kafka"`` makes participants append
      straight to Kafka.
    - Processes (``PARTICIPANTS``): ``policy``, ``agent``, ``counter`` (exported resources),
      ``verifier`` (stateless), ``restart`` (restart-only) and ``environment``; each runs
      ``python -m rolloutlog.participants.sim`` in its own process group on a fixed loopback
      port (``url(name)``), logging to ``data_dir/logs/<name>.log``.
    - ``policy_workers=N`` runs the policy as N worker processes (``policy --workers N``: one
      port, a shared ledger); the agent spreads its calls over them round robin, and holds,
      releases and ``stats("policy")`` cover every worker (``merge_policy_stats``).
    - Knobs: ``token_rate`` (tokens/s per call), ``chunk_tokens``, ``counter_verify`` and
      ``verifier_verify`` (``replay``/``wait``), ``verify_delay_s``; per task: rounds, tokens,
      constrained calls, verify delay, token rate (``make_task``).
    - Crashes: ``kill_participants()`` SIGKILLs every participant group, ``kill_service()`` the
      service's; ``start_participants(restore_id)`` starts them again (new epochs; the policy
      bulk-installs the restore's ledgers), ``start_service()`` restarts the service on the
      same data. ``skip_resources_restore=True`` is the negative control (the counter server
      ignores restored state).
    - Hold points: ``hold(name, point, capture_key)``, ``wait_held(…)``, ``release(…)`` park an
      episode at a named point of a participant and let it go (see each server's docstring for
      its points); ``stats(name)`` returns a participant's counters (``/sim/stats``).
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        run: str = "sim",
        partitions: int = 4,
        log_url: str | None = None,
        catalog_url: str | None = None,
        participant_transport: str = "http",
        token_rate: float = 2000.0,
        chunk_tokens: int = 16,
        counter_verify: str = "replay",
        verifier_verify: str = "replay",
        verify_delay_s: float = 0.0,
        policy_version: int = 1,
        fork_policy_version: int | None = None,
        policy_workers: int = 1,
        service_args: tuple[str, ...] = (),
        startup_timeout_s: float = 60.0,
    ) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rolloutlog-sim-")
            data_dir = self._tmp.name
        self.data_dir = Path(data_dir)
        self.run = run
        self.partitions = partitions
        self.log_url = log_url
        self.catalog_url = catalog_url
        self.participant_transport = participant_transport
        self.token_rate = token_rate
        self.chunk_tokens = chunk_tokens
        self.counter_verify = counter_verify
        self.verifier_verify = verifier_verify
        self.verify_delay_s = verify_delay_s
        self.policy_version = policy_version
        #: The fork demo: the same participant processes also serve any other run a rollout
        #: names (a fork of ``run``), the policy there at this version.
        self.fork_policy_version = fork_policy_version
        self.service_args = service_args
        self.startup_timeout_s = startup_timeout_s
        self.service = _Process("service", free_port())
        self.processes = {name: _Process(name, free_port()) for name in PARTICIPANTS}
        if policy_workers < 1:
            raise ValueError("policy_workers must be at least 1")
        #: each policy worker's own port (none with one worker)
        self.policy_worker_ports = [free_port() for _ in range(policy_workers)]
        if policy_workers == 1:
            self.policy_worker_ports = []
        self.restore_id: int | None = None
        self.skip_resources_restore = False
        self.timings: dict[str, float] = {}
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0))

    @property
    def service_url(self) -> str:
        return self.service.url

    def url(self, name: str) -> str:
        """The loopback URL of a participant process (``environment``, ``policy``, …)."""
        return self.processes[name].url

    def control_urls(self, name: str) -> list[str]:
        """Where a participant's ``/sim/*`` routes answer: each policy worker's own address
        (``policy_workers`` > 1), else the process's."""
        if name == "policy" and self.policy_worker_ports:
            return [f"http://127.0.0.1:{port}" for port in self.policy_worker_ports]
        return [self.url(name)]

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start the service and every participant (their starts overlap: participants wait
        for the service and the run to register), create the run; wait until all answer."""
        began = time.perf_counter()
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        try:
            self._spawn_service()
            self._spawn_participants(None, False)
            await self._ready(self.service, "/readyz")
            response = await self._client.post(
                f"{self.service_url}/v1/runs",
                json={"run": self.run, "partitions": self.partitions},
            )
            if response.status_code not in (200, 201, 409):
                raise RuntimeError(f"creating run {self.run!r}: {response.text}")
            await self._participants_ready()
        except BaseException:
            await self.stop()  # no process outlives a failed start
            raise
        self.timings["start_s"] = time.perf_counter() - began

    async def stop(self) -> None:
        """Stop every participant, then the service (SIGTERM; SIGKILL after a timeout)."""
        for process in self.processes.values():
            process.signal(signal.SIGTERM)
        for process in self.processes.values():
            process.terminate()
        self.service.terminate(30.0)
        await self._client.aclose()
        if self._tmp is not None:
            self._tmp.cleanup()

    async def start_service(self) -> None:
        """Start (or restart, on the same data) ``rolloutlog serve``; wait for ``/readyz``."""
        self._spawn_service()
        await self._ready(self.service, "/readyz")

    def _spawn_service(self) -> None:
        args = ["--data-dir", str(self.data_dir / "service"), "--port", str(self.service.port)]
        if self.log_url:
            args += ["--log", self.log_url]
        if self.catalog_url:
            args += ["--catalog", self.catalog_url]
        self._spawn(self.service, ["-m", "rolloutlog.api.cli", "serve", *args, *self.service_args])

    def kill_service(self) -> None:
        """SIGKILL the service's process group."""
        self.service.kill()

    async def start_participants(
        self, restore_id: int | None = None, *, skip_resources_restore: bool = False
    ) -> None:
        """Start every participant (again): each registers (a new epoch) before it is ready.
        ``restore_id``: the restore replacement attempts continue from (the policy installs its
        ledgers at start)."""
        began = time.perf_counter()
        self._spawn_participants(restore_id, skip_resources_restore)
        await self._participants_ready()
        self.timings["participants_start_s"] = time.perf_counter() - began

    def _spawn_participants(self, restore_id: int | None, skip_resources_restore: bool) -> None:
        self.restore_id = restore_id
        self.skip_resources_restore = skip_resources_restore
        for name in PARTICIPANTS:
            self._spawn(self.processes[name], self._participant_args(name))

    async def _participants_ready(self) -> None:
        await asyncio.gather(*(self._participant_ready(name) for name in self.processes))

    async def _participant_ready(self, name: str) -> None:
        for url in self.control_urls(name):
            await self._ready(self.processes[name], "/sim/ready", url)

    def kill_participants(self) -> None:
        """SIGKILL every participant process group (all at once, then reap)."""
        for process in self.processes.values():
            if process.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.proc.pid, signal.SIGKILL)
        for process in self.processes.values():
            process.kill()

    def kill(self, name: str) -> None:
        """SIGKILL one participant's process group."""
        self.processes[name].kill()

    async def start_one(self, name: str, restore_id: int | None = None) -> None:
        """Start one participant process (again)."""
        if restore_id is not None:
            self.restore_id = restore_id
        self._spawn(self.processes[name], self._participant_args(name))
        await self._participant_ready(name)

    def _participant_args(self, name: str) -> list[str]:
        role, participant_id = PARTICIPANTS[name]
        args = [
            "-m",
            "rolloutlog.participants.sim",
            role,
            "--port",
            str(self.processes[name].port),
            "--service-url",
            self.service_url,
            "--run",
            self.run,
            "--id",
            participant_id,
            "--transport",
            self.participant_transport,
        ]
        if self.participant_transport == "kafka":
            args += ["--log-url", self.log_url or ""]
        if self.restore_id is not None:
            args += ["--restore-id", str(self.restore_id)]
        resources = [f"--resources={kind}={self.url(kind)}" for kind in _MODES]
        if role == "policy":
            args += ["--token-rate", str(self.token_rate), "--chunk-tokens", str(self.chunk_tokens)]
            args += ["--policy-version", str(self.policy_version)]
            if self.fork_policy_version is not None:
                args += ["--fork-policy-version", str(self.fork_policy_version)]
            if self.policy_worker_ports:
                ports = ",".join(map(str, self.policy_worker_ports))
                args += ["--workers", str(len(self.policy_worker_ports)), "--worker-ports", ports]
        elif role == "agent":
            # one address per policy worker: the agent spreads its calls round robin, so a
            # rollout's consecutive calls land on different workers
            args += [f"--policy-url={url}" for url in self.control_urls("policy")]
            args += resources
        elif role == "environment":
            args += ["--agent-url", self.url("agent"), *resources]
        else:
            verify = {"counter": self.counter_verify, "verifier": self.verifier_verify}
            args += ["--mode", _MODES[name], "--verify", verify.get(name, "replay")]
            args += ["--verify-delay", str(self.verify_delay_s)]
            if self.skip_resources_restore:
                args.append("--skip-restore")
        return args

    def _spawn(self, process: _Process, args: list[str]) -> None:
        if process.alive:
            raise RuntimeError(f"{process.name} is already running")
        process.log = self.data_dir / "logs" / f"{process.name}.log"
        process.log.parent.mkdir(parents=True, exist_ok=True)
        # the sandbox's store under the Gym's data, not the machine's temporary directory
        env = {**os.environ, "ROLLOUTLOG_SIM_SANDBOX_DIR": str(self.data_dir / "sandbox")}
        (self.data_dir / "sandbox").mkdir(exist_ok=True)
        with open(process.log, "ab") as out:
            process.proc = subprocess.Popen(
                [sys.executable, *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    async def _ready(self, process: _Process, path: str, url: str | None = None) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if not process.alive:
                raise RuntimeError(f"{process.name} exited at start: {self.log_tail(process.name)}")
            with contextlib.suppress(httpx.HTTPError):
                address = url or process.url
                if (await self._client.get(address + path, timeout=2)).status_code == 200:
                    return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{process.name} was not ready in time: {self.log_tail(process.name)}")

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of a process's log (``service`` or a participant name)."""
        process = self.service if name == "service" else self.processes[name]
        if process.log is None or not process.log.exists():
            return ""
        return process.log.read_text(errors="replace")[-chars:]

    # -- holds and stats ---------------------------------------------------------------------

    async def hold(
        self,
        name: str,
        point: str,
        capture_key: str | None = None,
        *,
        after_tokens: int = 0,
        count: int = 1,
    ) -> None:
        """Arm a hold: the next ``count`` episodes reaching ``point`` at participant ``name``
        park there until ``release`` (armed on every policy worker)."""
        body: dict[str, Any] = {"point": point, "capture_key": capture_key}
        body |= {"after_tokens": after_tokens, "count": count}
        for url in self.control_urls(name):
            response = await self._client.post(url + "/sim/holds", json=body)
            response.raise_for_status()

    async def wait_held(
        self, name: str, point: str, capture_key: str | None = None, *, timeout_s: float = 60.0
    ) -> dict[str, Any]:
        """Wait until an episode is parked at an armed hold (on any policy worker); returns
        what it parked with."""
        params: dict[str, Any] = {"point": point, "timeout_s": timeout_s}
        if capture_key is not None:
            params["capture_key"] = capture_key

        async def wait(url: str) -> dict[str, Any]:
            response = await self._client.get(
                url + "/sim/holds/wait", params=params, timeout=timeout_s + 10
            )
            response.raise_for_status()
            result: dict[str, Any] = response.json()
            return result

        waits = [asyncio.ensure_future(wait(url)) for url in self.control_urls(name)]
        try:
            error: BaseException | None = None
            for next_done in asyncio.as_completed(waits):
                try:
                    return await next_done
                except httpx.HTTPStatusError as e:
                    error = e  # nothing parked on that worker: wait for the others
            assert error is not None
            raise error
        finally:
            for waiting in waits:
                waiting.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def release(
        self, name: str, point: str | None = None, capture_key: str | None = None
    ) -> int:
        """Release the matching holds; returns how many episodes were parked at them."""
        body = {"point": point, "capture_key": capture_key}
        released = 0
        for url in self.control_urls(name):
            response = await self._client.post(url + "/sim/holds/release", json=body)
            response.raise_for_status()
            released += int(response.json()["released"])
        return released

    async def stats(self, name: str) -> dict[str, Any]:
        """A participant's ``/sim/stats`` (its epoch, holds, and its kind's counters); a
        multi-worker policy's workers' stats merged (``merge_policy_stats``)."""
        results = []
        for url in self.control_urls(name):
            response = await self._client.get(url + "/sim/stats")
            response.raise_for_status()
            results.append(response.json())
        return results[0] if len(results) == 1 else merge_policy_stats(results)

    def collector(self, run: str | None = None, **kwargs: Any) -> Collector:
        """A ``Collector`` for this Gym's run (or ``run``: a fork of it, served by the same
        participant processes) and environment server."""
        from rolloutlog.participants.sim._collector import Collector

        return Collector(self.service_url, run or self.run, [self.url("environment")], **kwargs)


def merge_policy_stats(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """One view of a multi-worker policy's ``/sim/stats``: calls in the order they started,
    counters summed, installed rows per capture key (each worker installs the same ones), and
    ``workers`` (each one's own)."""
    calls = sorted((c for w in workers for c in w["calls"]), key=lambda c: c["t"])
    installed: dict[str, int] = {}
    parents: dict[str, int] = {}
    for w in workers:
        for key, count in w["installed"].items():
            installed[key] = max(installed.get(key, 0), count)
        for outcome, count in w["parents"].items():
            parents[outcome] = parents.get(outcome, 0) + count
    return {
        **workers[0],
        "epoch": [w["epoch"] for w in workers],
        "holds": [h for w in workers for h in w["holds"]],
        "calls": calls,
        "installed": installed,
        "chunks_skipped": sum(w["chunks_skipped"] for w in workers),
        "cuts_refused": sum(w["cuts_refused"] for w in workers),
        "appends_retried": sum(w["appends_retried"] for w in workers),
        "parents": parents,
        "workers": [
            {"worker": w["worker"], "calls": len(w["calls"]), "parents": w["parents"]}
            for w in workers
        ],
    }
