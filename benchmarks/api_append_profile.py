"""Where a service's CPU goes during ``api_append``'s throughput phase: a sampling profile.

Starts ``rolloutlog serve`` (embedded log) with a sampler in its process: every millisecond of
the process's CPU time (``ITIMER_PROF``) the ``SIGPROF`` handler, which Python runs in the main
thread, counts the functions on the main thread's stack. Samples follow CPU time rather than
wall-clock time, so neighbours on a busy machine do not skew the shares, and there is no
per-call cost (cProfile's per-call cost inflates code made of many small calls). CPU that the
log's writer threads use lands on whatever the main thread was doing then (often waiting in the
event loop). The clients run ``api_append.throughput`` twice: a warm-up (every episode created),
then the sampled phase. Prints each part's share of the samples (inclusive), and with ``--top N``
the N functions most often on top of the stack (self) and most often on it (inclusive). It also
splits the sampled phase's CPU per event by thread, from /proc: the service's main thread (the
event loop: HTTP, the route, the projector), its other threads (the log's writers and readers,
the catalog's), and the clients (this process).

    python benchmarks/api_append_profile.py [--seconds 6] [--tree DIR] [--top N]

``--tree`` runs the ``rolloutlog`` package under DIR instead of this tree's (e.g. one extracted
by ``api_append.extract``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT
from api_append import CLIENTS, RUN, Connection, Server, throughput

#: Run as ``python -c`` in the service's process: the sampler, then ``rolloutlog serve``.
_SAMPLER = """
import collections, signal, sys
from rolloutlog.api.cli import main
out = sys.argv[1]
inclusive = collections.Counter()
own = collections.Counter()
total = [0]

def sample(signum, frame):
    total[0] += 1
    if frame is not None:
        own[frame.f_code.co_filename + ":" + frame.f_code.co_name] += 1
    seen = set()
    while frame is not None:
        key = frame.f_code.co_filename + ":" + frame.f_code.co_name
        if key not in seen:
            seen.add(key)
            inclusive[key] += 1
        frame = frame.f_back

def start(*_):
    signal.setitimer(signal.ITIMER_PROF, 0.001, 0.001)

def stop(*_):
    signal.setitimer(signal.ITIMER_PROF, 0, 0)
    with open(out, "w") as f:
        f.write(f"{total[0]}\\n")
        f.writelines(f"{n} {key}\\n" for key, n in inclusive.most_common())
        f.write("self\\n")
        f.writelines(f"{n} {key}\\n" for key, n in own.most_common())

signal.signal(signal.SIGPROF, sample)
signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
sys.exit(main(sys.argv[2:]))
"""

#: The parts reported: (label, the end of a sampled ``file:function``).
PARTS = [
    ("the HTTP request, all of it", "httptools_impl.py:run_asgi"),
    ("  the append route", "api/_append.py:_serve"),
    ("    prepare: parse, validate, encode", "api/_prepare.py:prepare"),
    ("      orjson.loads of the body", "api/_prepare.py:parse_body"),
    ("      the fast path", "log/_record.py:fast_record"),
    ("      pydantic validate_event", "log/_codec.py:validate_event"),
    ("      pydantic encode_record", "log/_record.py:encode_record"),
    ("    fencing", "api/_append.py:check_fencing"),
    ("    records()", "api/_prepare.py:records"),
    ("    log.append_records", "log/embedded.py:append_records"),
    ("  FastAPI dependency solving", "dependencies/utils.py:solve_dependencies"),
    ("the projector's fold", "projections/_projector.py:_follow"),
    ("  its metadata check", "projections/_quarantine.py:metadata_problem"),
    ("  its record peek", "log/_record.py:peek_record"),
    ("  its episode trackers", "projections/_episode.py:observe"),
]


async def _drive(server: Server, proc: subprocess.Popen[bytes], seconds: float) -> None:
    await server.wait_ready()
    conn = Connection(server.port)
    await conn.open()
    await conn.request("POST", "/v1/runs", b'{"run": "%s", "partitions": 16}' % RUN.encode())
    for c in range(CLIENTS):
        body = b'{"id": "env-%d", "kind": "environment"}' % c
        await conn.request("POST", f"/v1/runs/{RUN}/participants", body)
    conn.close()
    _, seq = await throughput(server.port, seconds, 1)
    before, clients_before, started = (
        _thread_cpu(proc.pid),
        time.process_time(),
        time.perf_counter(),
    )
    proc.send_signal(signal.SIGUSR1)
    rate, _ = await throughput(server.port, seconds, seq)
    proc.send_signal(signal.SIGUSR2)
    after, clients = _thread_cpu(proc.pid), time.process_time() - clients_before
    events = rate * (time.perf_counter() - started)
    print(f"sampled phase: {rate:.0f} events/s; load average {os.getloadavg()[0]:.2f}")
    main_thread = [
        b - a for a, b in zip(before.get(proc.pid, (0, 0)), after[proc.pid], strict=True)
    ]
    others = [0.0, 0.0]
    for tid, cpu in after.items():
        if tid != proc.pid:
            for kind in (0, 1):
                others[kind] += cpu[kind] - before.get(tid, (0.0, 0.0))[kind]
    per_event = 1e6 / max(events, 1)
    for label, (user, system) in (("main thread", main_thread), ("other threads", others)):
        print(
            f"  service {label:14s} {(user + system) * per_event:5.2f} us/event "
            f"(user {user * per_event:.2f}, system {system * per_event:.2f})"
        )
    print(f"  clients (this process)       {clients * per_event:5.2f} us/event")


def _thread_cpu(pid: int) -> dict[int, tuple[float, float]]:
    """(user, system) CPU seconds of each thread of process ``pid``."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        found[int(task.name)] = (int(fields[11]) / tick, int(fields[12]) / tick)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--tree", type=Path, default=ROOT)
    parser.add_argument("--top", type=int, default=0, help="list the N commonest functions")
    args = parser.parse_args()
    server = Server(args.tree)
    out = Path(tempfile.mkstemp(prefix="rolloutlog-profile-")[1])
    command = [sys.executable, "-c", _SAMPLER, str(out), "serve", "--data-dir"]
    command += [str(server.data_dir), "--port", str(server.port), "--log-level", "warning"]
    proc = subprocess.Popen(command, cwd=args.tree, stdout=subprocess.DEVNULL)
    server.proc = proc
    try:
        asyncio.run(_drive(server, proc, args.seconds))
        for _ in range(50):
            if out.stat().st_size:
                break
            time.sleep(0.1)  # the service writes the samples on SIGUSR2
    finally:
        server.stop()
    lines = out.read_text().splitlines()
    out.unlink()
    total = int(lines[0])
    split = lines.index("self")
    counts = _counts(lines[1:split])
    print(f"{total} samples of the service's main thread (tree {args.tree})")
    for label, suffix in PARTS:
        share = sum(n for key, n in counts.items() if key.endswith(suffix)) / max(total, 1)
        print(f"  {label:42s} {share * 100:5.1f}%")
    for title, table in (("self", _counts(lines[split + 1 :])), ("inclusive", counts)):
        if args.top:
            print(f"top {args.top}, {title}:")
        for key, n in list(table.items())[: args.top]:
            print(f"  {n / max(total, 1) * 100:5.1f}%  {key.removeprefix(str(args.tree) + '/')}")


def _counts(lines: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in lines:
        count, key = line.split(" ", 1)
        counts[key] = int(count)
    return counts


if __name__ == "__main__":
    main()
