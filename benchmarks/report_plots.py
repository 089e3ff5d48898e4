"""The report's plots: one per curve (against live rollouts, against state size), every
deployment's points on it, saved beside the results as ``curve_*.png``."""

from __future__ import annotations

from typing import Any

from _common import DEPLOYMENTS, RESULTS
from report_format import numeric_order

#: Line style of each deployment in the plots (the figure gives the colour).
STYLES = {"embedded": "-", "kafka": "--"}


def plot(results: dict[str, Any], suffix: str) -> list[str]:
    """One plot per curve, every deployment's points on it (line style by deployment)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    curves = results.get("curves") or {}
    for key, label, unit in (
        ("live_rollouts", "live rollouts", 1.0),
        ("state_bytes", "session state size", 1024.0),
    ):
        series = {
            name: numeric_order(per.get(key) or {}) for name, per in curves.items() if per.get(key)
        }
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(8, 6.5), dpi=110)
        ticks: set[float] = set()
        for name, points in series.items():
            xs = [int(x) / unit for x in points]
            ticks.update(xs)
            for index, (figure, label_) in enumerate(
                (
                    ("checkpoint_s", "checkpoint (live)"),
                    ("checkpoint_cold_s", "first (cold) checkpoint"),
                    ("restore_s", "restore (plan)"),
                    ("restore_and_fetch_s", "restore + fetch"),
                    ("floor_s", "floor (read + split)"),
                )
            ):
                mine = [
                    (x, p[figure]) for x, p in zip(xs, points.values(), strict=True) if figure in p
                ]
                if not mine:
                    continue
                ax.errorbar(
                    [x for x, _ in mine],
                    [f["median"] for _, f in mine],
                    yerr=[
                        [f["median"] - f["min"] for _, f in mine],
                        [f["max"] - f["median"] for _, f in mine],
                    ],
                    fmt="o" + STYLES.get(name, "-."),
                    color=f"C{index}",
                    markersize=3,
                    capsize=2,
                    label=f"{label_}, {DEPLOYMENTS.get(name, name)}",
                )
        # The stop-the-world baseline does not depend on the deployment: one line.
        stw: dict[float, float] = {}
        for points in series.values():
            for x, p in points.items():
                if p.get("stop_the_world"):
                    stw[int(x) / unit] = p["stop_the_world"]["checkpoint_s"]["median"]
        if stw:
            xs_stw = sorted(stw)
            ax.plot(
                xs_stw,
                [stw[x] for x in xs_stw],
                "^-.",
                color="C5",
                label="stop-the-world checkpoint (lower bound)",
            )
        xs = sorted(ticks)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(xs)
        if key == "state_bytes":
            ax.set_xticklabels([f"{x:g} KB" if x < 1024 else f"{x / 1024:g} MB" for x in xs])
        else:
            ax.set_xticklabels([f"{x:g}" if x < 1000 else f"{x / 1000:g}k" for x in xs])
        ax.minorticks_off()
        ax.set_xlabel(label)
        ax.set_ylabel("seconds (median, bars: min-max)")
        rollouts = {per.get("state_rollouts") for per in curves.values()}
        count = (
            f", {rollouts.pop()} rollouts" if key == "state_bytes" and len(rollouts) == 1 else ""
        )
        lines = {"-": "solid", "--": "dashed"}
        names = "; ".join(
            f"{DEPLOYMENTS.get(name, name)}: {lines.get(STYLES.get(name, ''), 'dash-dot')}"
            for name in series
        )
        ax.set_title(
            f"Checkpoint and restore vs {label}{count}\n({names})",
            fontsize=10,
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13))
        fig.tight_layout()
        name = f"curve_{key}{suffix}.png"
        fig.savefig(RESULTS / name)
        plt.close(fig)
        made.append(name)
    return made
