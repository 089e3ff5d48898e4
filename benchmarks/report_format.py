"""How the report writes a figure: durations, spreads, ratios, a checkpoint's stage timings,
curve points in order, the seed's figures."""

from __future__ import annotations

import math
from typing import Any


def ms(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value * 1e3:,.0f} ms" if value < 10 else f"{value:,.1f} s"


def spread(figure: dict[str, float] | None) -> str:
    if not figure:
        return "n/a"
    return f"{ms(figure['median'])} ({ms(figure['min'])}-{ms(figure['max'])})"


def times(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:.2f}x" if value < 10 else f"{value:.0f}x"


def median(figure: dict[str, Any] | None) -> float | None:
    return figure["median"] if figure else None


def checkpoint_stages(workload: dict[str, Any]) -> str:
    """A workload's checkpoint stage timings (median ms), as the service reported them."""
    stages = (workload.get("stages_ms") or {}).get("checkpoint") or {}
    return ", ".join(f"{k} {v:,.0f}" for k, v in stages.items()) or "not recorded"


def numeric_order(points: dict[str, Any]) -> dict[str, Any]:
    """Curve points by their x (the JSON keeps keys sorted as strings)."""
    return dict(sorted(points.items(), key=lambda item: int(item[0])))


def curve_span(points: dict[str, Any]) -> str:
    xs = sorted(int(x) for x in points)
    return f"{xs[0]:,} → {xs[-1]:,}" if xs else ""


def seed_figures(seed: dict[str, Any]) -> str:
    """The seed system's published figures, as the suite keeps them (``suite.SEED``)."""
    return "\n".join(
        f"> - {key}: "
        + ", ".join(f"{name} {value} s" for name, value in figures.items() if name != "note")
        + f" ({figures.get('note', '')})"
        for key, figures in seed.items()
    )


def churn_rollouts(results: dict[str, Any]) -> str:
    """How many rollouts advance between two measured checkpoints (as the suite recorded it)."""
    for per in results.get("deployments", {}).values():
        for figures in per.values():
            churn = figures.get("churn") if isinstance(figures, dict) else None
            if churn:
                return f"{churn['rollouts_per_checkpoint']:,}"
    return "a fixed number of"
