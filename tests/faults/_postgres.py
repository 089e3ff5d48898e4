"""A throwaway PostgreSQL cluster that a test may SIGKILL and restart: ``initdb`` into a temp dir,
then ``postgres -p PORT -D DIR -k DIR`` on a free loopback port, both as user ``postgres`` (the
server refuses to run as root). The machine's own cluster (5432) is never touched.

``kill()`` SIGKILLs the postmaster and its backends by PID (each backend is its own process group
leader, so a group kill would miss them); ``start()`` brings the cluster back on the same port and
data dir, through crash recovery, as an operator's restart would. ``freeze()``/``thaw()``
SIGSTOP/SIGCONT the same processes: a stalled server.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests._services import free_port, port_open, unavailable

START_S = 30.0


def _binaries() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def _children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The command name may hold spaces and parentheses: the ppid follows the last ')'.
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(stat.split("/")[2]))
    return out


class PostgresCluster:
    """One throwaway cluster: ``start()``, ``kill()``, ``url``; ``close()`` removes it."""

    def __init__(self, binaries: Path) -> None:
        self.binaries = binaries
        self.root = Path(tempfile.mkdtemp(prefix="rolloutlog-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:  # the server refuses root: run it as the postgres user
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        self.output = self.root / "server.log"

    @property
    def url(self) -> str:
        """The catalog URL of its ``postgres`` database."""
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def init(self) -> None:
        subprocess.run(
            [
                str(self.binaries / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "-A",
                "trust",
                "--no-sync",
                "--no-instructions",
            ],
            check=True,
            capture_output=True,
            **self._as,
        )

    def start(self) -> None:
        """Start (or restart after ``kill``) on the same port and data dir; wait until it takes
        connections."""
        assert self.proc is None or self.proc.poll() is not None
        with open(self.output, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    str(self.binaries / "postgres"),
                    "-D",
                    str(self.data),
                    "-p",
                    str(self.port),
                    "-k",
                    str(self.root),
                    "-h",
                    "127.0.0.1",
                    # A SIGKILL leaves the OS's page cache intact: fsync only costs time here.
                    "-c",
                    "fsync=off",
                    "-c",
                    "shared_buffers=16MB",
                    "-c",
                    "max_connections=40",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **self._as,
            )
        deadline = time.monotonic() + START_S
        while not self._ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited: {self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not get ready in {START_S} s: {self.tail()}")
            time.sleep(0.05)

    def _ready(self) -> bool:
        if not port_open("127.0.0.1", self.port, timeout=0.2):
            return False
        done = subprocess.run(
            [str(self.binaries / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)],
            check=False,
            capture_output=True,
        )
        return done.returncode == 0

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend: the database vanishes mid-whatever."""
        assert self.proc is not None
        pids = [self.proc.pid, *_children(self.proc.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        # The backends are the postmaster's children, reparented on its death: wait until they
        # are gone, or the restart finds its shared memory still attached.
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids[1:]) and time.monotonic() < deadline:
            time.sleep(0.02)

    def freeze(self) -> None:
        """SIGSTOP the postmaster and every backend: connections stay open, nothing answers
        (a hung host or a network path that drops packets)."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT what ``freeze`` stopped (and any backend forked since: none, it was stopped)."""
        self._signal(signal.SIGCONT)

    def _signal(self, signum: int) -> None:
        assert self.proc is not None and self.proc.poll() is None
        for pid in [self.proc.pid, *_children(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.thaw()  # a frozen postmaster would not reap its SIGKILLed backends
            self.kill()  # throwaway: nothing to shut down cleanly for
        shutil.rmtree(self.root, ignore_errors=True)

    def tail(self) -> str:
        return self.output.read_text(errors="replace")[-3000:] if self.output.exists() else ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@contextlib.contextmanager
def postgres_cluster() -> Iterator[PostgresCluster]:
    """A started throwaway cluster (skips, or fails in CI, where PostgreSQL is not installed)."""
    binaries = _binaries()
    if binaries is None:
        unavailable("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin")
    assert binaries is not None
    cluster = PostgresCluster(binaries)
    try:
        try:
            cluster.init()
            cluster.start()
        except (OSError, KeyError, subprocess.CalledProcessError, RuntimeError) as e:
            unavailable(f"cannot start a throwaway PostgreSQL cluster: {e}")
        yield cluster
    finally:
        cluster.close()
