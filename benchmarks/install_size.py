"""What ``pip install`` costs: seconds, megabytes of site-packages and distributions, in a
fresh venv, of the base install (the participant SDK and the clients), of ``[server]``, and of
a former revision's plain install (``--before REV``: every dependency was core then).

    python benchmarks/install_size.py --python python3.12 --before REV [--runs 3]

Each case is installed once first (pip's cache and the build of the wheel warm, not counted),
then ``--runs`` times into a new venv each, the cases interleaved; venv creation is not timed.
The base and ``[server]`` cases install the committed HEAD.
Saves benchmarks/results/install_size.json.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, save, summary


def _wheel(python: str, rev: str, work: Path) -> Path:
    """rolloutlog's wheel built from the tree at ``rev`` (outside the working tree)."""
    tree, out = work / f"tree-{rev}", work / f"wheel-{rev}"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    build = [python, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(tree)]
    subprocess.run(build, check=True, capture_output=True)
    (wheel,) = out.glob("rolloutlog-*.whl")
    return wheel


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _install(python: str, spec: str, work: Path) -> dict[str, float]:
    venv = work / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    empty = _size(site)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([*pip, "install", "--quiet", spec], check=True, capture_output=True)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    listed = subprocess.run(
        [*pip, "list", "--format=freeze"], check=True, capture_output=True, text=True
    )
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "mb": (_size(site) - empty) / 1e6,
        "distributions": sum(not line.startswith("pip==") for line in listed.stdout.splitlines()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--python", default="python3", help="the interpreter of the venvs")
    parser.add_argument("--before", metavar="REV", help="also a former revision's install")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="install-size-") as tmp:
        work = Path(tmp)
        here = _wheel(args.python, "HEAD", work)
        cases = {"base": str(here), "server": f"{here}[server]"}
        if args.before:
            cases = {"before": str(_wheel(args.python, args.before, work)), **cases}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
        for spec in cases.values():
            _install(args.python, spec, work)  # warm
        for _ in range(args.runs):
            for name, spec in cases.items():
                runs[name].append(_install(args.python, spec, work))
                print(name, runs[name][-1], flush=True)
    python = subprocess.run(
        [args.python, "-c", "import platform; print(platform.python_version())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    results: dict[str, Any] = {"venv_python": python, "before": args.before, "cases": {}}
    for name, measured in runs.items():
        results["cases"][name] = {
            "seconds": summary([m["seconds"] for m in measured]),
            "cpu_seconds": summary([m["cpu_seconds"] for m in measured]),
            "mb": summary([m["mb"] for m in measured]),
            "distributions": measured[0]["distributions"],
        }
    for name, case in results["cases"].items():
        print(
            f"{name:7} {case['seconds']['median']:6.1f} s ({case['cpu_seconds']['median']:.1f} s "
            f"CPU)  {case['mb']['median']:6.1f} MB  "
            f"{case['distributions']} distributions"
        )
    print(f"saved {save('install_size', results)}")


if __name__ == "__main__":
    main()
