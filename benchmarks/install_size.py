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
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, save, summary


def _source(rev: str, into: Path) -> Path:
    """The project's tree at ``rev``, outside the working tree (pip builds in the tree)."""
    into.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _install(python: str, spec: str, work: Path) -> dict[str, float]:
    venv = work / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    empty = _size(site)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    started = time.perf_counter()
    subprocess.run([*pip, "install", "--quiet", spec], check=True, capture_output=True)
    seconds = time.perf_counter() - started
    listed = subprocess.run(
        [*pip, "list", "--format=freeze"], check=True, capture_output=True, text=True
    )
    return {
        "seconds": seconds,
        "mb": (_size(site) - empty) / 1e6,
        "distributions": len(listed.stdout.splitlines()) - 1,  # pip itself is not installed
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--python", default="python3", help="the interpreter of the venvs")
    parser.add_argument("--before", metavar="REV", help="also a former revision's install")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="install-size-") as tmp:
        work = Path(tmp)
        here = _source("HEAD", work / "here")
        cases = {"base": str(here), "server": f"{here}[server]"}
        if args.before:
            cases = {"before": str(_source(args.before, work / "before")), **cases}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
        for name, spec in cases.items():
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
            "mb": summary([m["mb"] for m in measured]),
            "distributions": measured[0]["distributions"],
        }
    for name, case in results["cases"].items():
        print(
            f"{name:7} {case['seconds']['median']:6.1f} s  {case['mb']['median']:6.1f} MB  "
            f"{case['distributions']} distributions"
        )
    print(f"saved {save('install_size', results)}")


if __name__ == "__main__":
    main()
