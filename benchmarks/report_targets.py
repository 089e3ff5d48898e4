"""The report's targets: a row per target and deployment (met or missed), the targets of one
deployment and the curves' flatness, and what was measured about each missed one
(``measured_split``), from the suite's JSON only."""

from __future__ import annotations

import math
from typing import Any

from _common import DEPLOYMENTS
from report_format import checkpoint_stages, curve_span, median, ms, numeric_order, times


def target_rows(results: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """The "Targets" section's lines, the missed targets (each a sentence) and the ``CAUSES``
    keys of the missed ones, in the order they were missed."""
    deployments = results.get("deployments", {})
    ratios = results.get("ratios", {})
    targets = results.get("targets", {})
    out: list[str] = []
    w = out.append
    w("## Targets")
    w("")
    w("| target | " + " | ".join(DEPLOYMENTS[d] for d in deployments) + " |")
    w("|---|" + "---|" * len(deployments))
    missed: list[str] = []
    #: The ``CAUSES`` keys of the missed targets, in the order they were missed.
    reasons: list[str] = []

    def row(
        label: str,
        getter: Any,
        target: float,
        higher_is_better: bool,
        fmt: Any,
        why: str = "",
        informative: bool = False,
    ) -> None:
        cells = []
        for name, per in deployments.items():
            value = getter(name, per)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                cells.append("n/a")
                continue
            met = value >= target if higher_is_better else value <= target
            cells.append(f"{fmt(value)} {'✅' if met else '❌'}")
            if not met and not informative:
                by = value / target if not higher_is_better else target / value
                missed.append(
                    f"{label} on {DEPLOYMENTS[name]}: measured {fmt(value)} (missed by {by:.1f}x)"
                )
                if why and why not in reasons:
                    reasons.append(why)
        w(f"| {label} | " + " | ".join(cells) + " |")

    def fig(workload: str, key: str) -> Any:
        return lambda name, per: median(per.get(workload, {}).get(key))

    def rat(key: str) -> Any:
        return lambda name, per: ratios.get(name, {}).get(key)

    # The targets (suite.TARGETS), a row each.
    row(
        "S1 checkpoint ≥ 20x faster than stop-the-world (live: a checkpoint after the previous one)",
        rat("S1.checkpoint_vs_stop_the_world"),
        targets["S1.checkpoint_vs_stop_the_world"],
        True,
        times,
        "checkpoint_vs_stop_the_world",
    )
    row(
        "S1 first (cold) checkpoint vs stop-the-world (informative: the whole manifest)",
        rat("S1.cold_checkpoint_vs_stop_the_world"),
        targets["S1.checkpoint_vs_stop_the_world"],
        True,
        times,
        informative=True,
    )
    for key in ("S1", "S2"):
        row(
            f"{key} restore + fetch within 1.5x of the read floor",
            fig(key, "restore_and_fetch_over_floor"),
            targets["restore_and_fetch_over_floor"],
            False,
            times,
            "restore_and_fetch_over_floor",
        )
    for key in ("S1", "S2"):
        row(
            f"{key} restore + fetch faster than the stop-the-world restore",
            rat(f"{key}.restore_and_fetch_vs_stop_the_world_restore"),
            1.0,
            True,
            times,
            "restore_and_fetch_vs_stop_the_world_restore",
        )
        row(
            f"{key} restore + fetch faster than pyeventsourcing's reconstruction",
            rat(f"{key}.restore_and_fetch_vs_eventsourcing"),
            1.0,
            True,
            times,
            "restore_and_fetch_vs_eventsourcing",
        )
    row(
        "S4 checkpoint under saturating appends within 2x of S1's",
        rat("S4.checkpoint_over_S1"),
        targets["S4.checkpoint_over_S1"],
        False,
        times,
        "S4.checkpoint_over_S1",
    )
    row(
        "service peak RSS, S1 restore + fetch ≤ 400 MB",
        lambda name, per: per.get("S1", {}).get("restore_peak_rss_mb"),
        targets["S1.restore_peak_rss_mb"],
        False,
        lambda mb: f"{mb:,.0f} MB",
        "restore_peak_rss_mb",
    )
    seed = results.get("seed", {})
    for key, figure in (
        ("S1", "checkpoint_s"),
        ("S2", "checkpoint_s"),
        ("S1", "restore_s"),
        ("S2", "restore_s"),
        ("S3", "restore_s"),
    ):
        published = seed.get(key, {}).get(figure)
        if published:
            row(
                f"{key} {figure.split('_')[0]} faster than the seed's published {published} s "
                "(informative: another machine)",
                lambda name, per, k=key, f=figure, p=published: (
                    p / median(per[k][f]) if per.get(k, {}).get(f) else None
                ),
                1.0,
                True,
                times,
                informative=True,
            )
    # Figures of one deployment each (other parts of the suite: ``appends``, ``fold_rate``).
    appends = results.get("appends") or {}
    fold = results.get("fold_rate") or {}
    single = [
        (
            "HTTP append, one service, batches of 100, 8 clients ≥ 50k events/s (embedded)",
            median(appends.get("events_per_s")),
            targets["appends.events_per_s"],
            True,
            lambda v: f"{v:,.0f} events/s",
            "appends",
        ),
        (
            "HTTP append p99 at half load ≤ 25 ms (embedded)",
            median(appends.get("half_load_p99_ms")),
            targets["appends.p99_half_load_ms"],
            False,
            lambda v: f"{v:.0f} ms",
            "appends",
        ),
        (
            "projector fold rate on Kafka ≥ 200k events/s",
            median(fold.get("events_per_s")),
            targets["fold_rate.events_per_s"],
            True,
            lambda v: f"{v:,.0f} events/s",
            "fold_rate",
        ),
    ]
    w("")
    w("| target (one deployment) | measured |")
    w("|---|---|")
    for label, value, target, higher, fmt, why in single:
        if value is None:
            w(f"| {label} | not measured in this run |")
            continue
        met = value >= target if higher else value <= target
        w(f"| {label} | {fmt(value)} {'✅' if met else '❌'} |")
        if not met:
            by = target / value if higher else value / target
            missed.append(f"{label}: measured {fmt(value)} (missed by {by:.1f}x)")
            if why not in reasons:
                reasons.append(why)
    flatness = ratios.get("curves", {})
    curves = results.get("curves") or {}
    if flatness:
        names = list(flatness)
        w("")
        w(
            "| flatness (max/min of the medians over the curve; the span in brackets) | "
            + " | ".join(DEPLOYMENTS.get(n, n) for n in names)
            + " |"
        )
        w("|---|" + "---|" * len(names))
        for key, label, target in (
            ("live_rollouts.checkpoint_s", "checkpoint (live) vs live rollouts within 2x", True),
            (
                "live_rollouts.checkpoint_cold_s",
                "first (cold) checkpoint vs live rollouts (informative)",
                False,
            ),
            ("state_bytes.checkpoint_s", "checkpoint (live) vs state size within 2x", True),
            ("live_rollouts.restore_s", "restore vs live rollouts (informative)", False),
            ("state_bytes.restore_s", "restore vs state size (informative)", False),
        ):
            cells = []
            for name in names:
                value = flatness[name].get(f"{key}.max_over_min")
                if value is None:
                    cells.append("n/a")
                    continue
                span = curve_span(curves.get(name, {}).get(key.split(".")[0]) or {})
                if not target:
                    cells.append(f"{times(value)} ({span})")
                    continue
                met = value <= targets["curve_flatness"]
                cells.append(f"{times(value)} {'✅' if met else '❌'} ({span})")
                if not met:
                    missed.append(
                        f"{label} on {DEPLOYMENTS.get(name, name)} ({span}): measured "
                        f"{value:.2f}x (missed by {value / targets['curve_flatness']:.1f}x)"
                    )
                    if "curve_flatness" not in reasons:
                        reasons.append("curve_flatness")
            w(f"| {label} | " + " | ".join(cells) + " |")
    return out, missed, reasons


def measured_split(reason: str, results: dict[str, Any]) -> str:
    """What the suite measured about a missed target, split into its parts (from the JSON only)."""
    deployments = results.get("deployments", {})
    baselines = results.get("baselines", {})
    parts: list[str] = []
    for name, per in deployments.items():
        where = DEPLOYMENTS.get(name, name)
        for key in ("S1", "S2"):
            f = per.get(key) or {}
            if reason.startswith("restore_and_fetch") and "restore_and_fetch_s" in f:
                restore, total = median(f["restore_s"]), median(f["restore_and_fetch_s"])
                assert restore is not None and total is not None
                split = (
                    f"{key} on {where}: restore (plan) {ms(restore)} + fetch {ms(total - restore)}"
                    f" = {ms(total)}"
                )
                base = baselines.get(key, {})
                if reason.endswith("over_floor"):
                    split += f", floor {ms(median(f.get('floor_s')))}"
                    if f.get("socket_s"):
                        split += (
                            f" (its {median(f['floor_mb']):,.0f} MB through a loopback socket "
                            f"alone: {ms(median(f['socket_s']))}, "
                            f"{median(f['socket_over_floor']):.2f}x the floor)"
                        )
                elif reason.endswith("stop_the_world_restore") and base.get("stop_the_world"):
                    split += f", stop-the-world restore {ms(median(base['stop_the_world']['restore_s']))}"
                elif reason.endswith("eventsourcing") and base.get("eventsourcing"):
                    split += (
                        f", pyeventsourcing {ms(median(base['eventsourcing']['reconstruct_s']))}"
                    )
                parts.append(split)
        s1 = per.get("S1") or {}
        if reason == "checkpoint_vs_stop_the_world" and s1:
            parts.append(
                f"S1 on {where}: checkpoint {ms(median(s1['checkpoint_s']))} (service stages, "
                f"median ms: {checkpoint_stages(s1)})"
            )
        s4 = per.get("S4")
        if reason == "S4.checkpoint_over_S1" and s4 and s1:
            parts.append(
                f"{where}: {ms(median(s4['checkpoint_s']))} against S1's "
                f"{ms(median(s1['checkpoint_s']))} while the SDK appended "
                f"{s4['appends']['events_per_s']:,.0f} events/s (service stages, median ms: "
                f"S4 {checkpoint_stages(s4)}; S1 {checkpoint_stages(s1)})"
            )
        if reason == "restore_peak_rss_mb" and "restore_peak_rss_mb" in s1:
            parts.append(
                f"{where}: {s1['restore_peak_rss_mb']:,.0f} MB from the first restore to the last "
                f"fetch; {s1['service_peak_rss_mb']:,.0f} MB over the service's whole life (load, "
                "checkpoints, restores, S4)"
                + (
                    "; its RSS after each fetch, in order: "
                    + ", ".join(f"{mb:,.0f}" for mb in s1["rss_after_fetch_mb"])
                    + " MB"
                    if s1.get("rss_after_fetch_mb")
                    else ""
                )
            )
    if reason == "curve_flatness":
        for name, per in (results.get("curves") or {}).items():
            points = numeric_order(per.get("live_rollouts") or {})
            if points:
                parts.append(
                    f"checkpoint (live) on {DEPLOYMENTS.get(name, name)}: "
                    + ", ".join(
                        f"{int(x):,} → {ms(median(p.get('checkpoint_s')))}"
                        for x, p in points.items()
                    )
                )
    appends = results.get("appends") or {}
    if reason == "appends" and appends:
        parts.append(
            f"{median(appends['events_per_s']):,.0f} events/s closed loop, p99 "
            f"{median(appends['half_load_p99_ms']):.0f} ms at half load (p50 "
            f"{median(appends['half_load_p50_ms']):.0f} ms); service CPU "
            f"{median(appends['cpu_us_per_event']):.0f} µs per event"
        )
    fold = results.get("fold_rate") or {}
    if reason == "fold_rate" and fold:
        parts.append(
            f"{median(fold['events_per_s']):,.0f} events/s: {fold['records']:,} records of "
            f"{fold['live']:,} live episodes folded from Kafka by a fresh projector in "
            f"{ms(median(fold['catch_up_s']))} ({fold['events_per_s']['runs']} runs)"
        )
    return "; ".join(parts) + "." if parts else ""
