"""An append's preparation in one process: the fast path against the pydantic path.

``_prepare.prepare`` (parse a body of 100 envelopes, validate each, encode each record, note what
fencing reads) timed on the same bodies two ways, alternately, round by round: as it runs
(``fast path``: ``log.fast_record`` takes every envelope here) and with the fast path turned off
(``pydantic``: every envelope through ``validate_event`` + ``encode_record``, what ``prepare``
does without it). ``parse only`` is the ``orjson.loads`` of the same body, the floor.
Bodies: ``api_append``'s (``step.boundary``, ~250 bytes) and a mix of every client event type.
Each figure is microseconds per event, median (min, max) over ``--rounds`` rounds; results go to
``benchmarks/results/api_append_prepare.json``.

    python benchmarks/api_append_prepare.py [--rounds 7]

With ``--compare REF`` it times instead the route's per-event work outside the log and the
HTTP stack (``prepare``, the batch's ``records`` and the reply's offsets body) as this tree's
``api/_prepare.py`` and ``api/_append.py`` do it and as git ``REF``'s do it (both loaded in this
process, on this tree's ``log`` package), alternately, round by round; results go to
``benchmarks/results/api_append_prepare_compare.json`` (for the commit message; not committed).

    python benchmarks/api_append_prepare.py --compare REF [--rounds 7]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import orjson
from _common import ROOT, save, summary
from api_append import BATCH, bodies

from rolloutlog.api import _append, _prepare
from rolloutlog.log import encode_event
from tests import factories as f


def _mixed() -> list[bytes]:
    """Bodies of 100 envelopes cycling through every client event type."""
    makers: list[Callable[[str], Any]] = [
        f.started,
        f.step_started,
        lambda e: f.boundary(e, state={"turn": 1, "note": "x" * 40}),
        lambda e: f.ledger_row(e, token_ids=list(range(64))),
        f.chunk,
        f.session_started,
        f.session_state,
        lambda e: f.finished(e, result={"score": 1}),
    ]
    events = [orjson.loads(encode_event(makers[i % len(makers)](f"m{i}"))) for i in range(BATCH)]
    return [orjson.dumps(events)] * 50


def _time(run: Callable[[], object], events: int) -> float:
    started = time.process_time()
    run()
    return (time.process_time() - started) / events * 1e6


def _prepare_all(payloads: list[bytes]) -> Callable[[], object]:
    return lambda: [_prepare.prepare(body, False, 16, 1 << 20) for body in payloads]


def _parse_all(payloads: list[bytes]) -> Callable[[], object]:
    return lambda: [orjson.loads(body) for body in payloads]


@contextlib.contextmanager
def _without_fast_path() -> Iterator[None]:
    """``prepare`` with no envelope taken by the fast path."""
    fast = getattr(_prepare, "fast_record")  # noqa: B009 (not part of the module's interface)
    setattr(_prepare, "fast_record", lambda value: None)  # noqa: B010
    try:
        yield
    finally:
        setattr(_prepare, "fast_record", fast)  # noqa: B010


def _module_at(ref: str, path: str, name: str) -> ModuleType:
    """The module at ``path`` as git ``ref`` has it, loaded under ``name``."""
    source = subprocess.run(
        ["git", "show", f"{ref}:{path}"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and NamedTuples look their module up
    exec(compile(source, f"{ref}:{path}", "exec"), module.__dict__)
    return module


def _route_work(
    prepare: ModuleType, append: ModuleType, payloads: list[bytes]
) -> Callable[[], object]:
    """Per body: ``prepare``, ``records`` and the offsets body of as many positions."""
    positions = [(i % 16, i) for i in range(BATCH)]

    def run() -> None:
        for body in payloads:
            batch = prepare.prepare(body, False, 16, 1 << 20)
            prepare.records(batch)
            _drive(append._offsets_body(positions))

    return run


def _drive(coroutine: Any) -> Any:
    """A coroutine that never awaits anything pending, run to its end without a loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("the coroutine awaited something")


def _compare(ref: str, rounds: int) -> None:
    sides = {
        f"before ({ref})": (
            _module_at(ref, "rolloutlog/api/_prepare.py", "_prepare_before"),
            _module_at(ref, "rolloutlog/api/_append.py", "_append_before"),
        ),
        "after (this tree)": (_prepare, _append),
    }
    workloads = {"step.boundary (api_append)": bodies(200, 1), "every client type": _mixed()}
    document: dict[str, Any] = {"compare": ref, "rounds": rounds, "batch": BATCH, "workloads": {}}
    for name, payloads in workloads.items():
        events = len(payloads) * BATCH
        times: dict[str, list[float]] = {side: [] for side in sides}
        for modules in sides.values():
            _route_work(*modules, payloads)()  # warm
        for _ in range(rounds):
            for side, modules in sides.items():
                times[side].append(_time(_route_work(*modules, payloads), events))
        _report(document, name, times)
    document["load_average_after"] = os.getloadavg()[0]
    print(f"saved {save('api_append_prepare_compare', document)}")


def _report(document: dict[str, Any], name: str, times: dict[str, list[float]]) -> None:
    """One workload's medians per side, into ``document`` and printed."""
    figures = {side: summary(values) for side, values in times.items()}
    document["workloads"][name] = {"us_per_event": figures}
    print(
        f"{name}: "
        + ", ".join(f"{side} {s['median']:.2f} us/event" for side, s in figures.items())
        + f" (load average {os.getloadavg()[0]:.2f})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compare", default="", help="git ref whose route work is compared")
    args = parser.parse_args()
    if args.compare:
        _compare(args.compare, args.rounds)
        return
    workloads = {"step.boundary (api_append)": bodies(200, 1), "every client type": _mixed()}
    document: dict[str, Any] = {"rounds": args.rounds, "batch": BATCH, "workloads": {}}
    for name, payloads in workloads.items():
        events = len(payloads) * BATCH
        times: dict[str, list[float]] = {"fast path": [], "pydantic": [], "parse only": []}
        _prepare_all(payloads)()  # warm: names and episode ids remembered, validators built
        for _ in range(args.rounds):
            times["fast path"].append(_time(_prepare_all(payloads), events))
            with _without_fast_path():
                times["pydantic"].append(_time(_prepare_all(payloads), events))
            times["parse only"].append(_time(_parse_all(payloads), events))
        _report(document, name, times)
    document["load_average_after"] = os.getloadavg()[0]
    print(f"saved {save('api_append_prepare', document)}")


if __name__ == "__main__":
    main()
