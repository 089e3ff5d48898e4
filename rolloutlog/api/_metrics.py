"""A small Prometheus text exposition (format 0.0.4): counters, gauges and histograms.

Written here rather than pulled in with ``prometheus_client``: the service needs a dozen series,
an observation must cost a dict lookup and a bisect on the append path, and gauges are read from
the projectors at scrape time.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

__all__ = ["Counter", "Gauge", "Histogram", "ReadCounter", "Registry"]

Labels = tuple[str, ...]
M = TypeVar("M", bound="_Metric")

#: Latency buckets (seconds) from 0.5 ms to 60 s.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Labels, extra: str = "") -> str:
    parts = [f'{name}="{_escape(value)}"' for name, value in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def lines(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self.values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, labels: Labels = ()) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def lines(self) -> list[str]:
        if not self.values and not self.label_names:
            return [f"{self.name} 0"]
        return [
            f"{self.name}{_labels(self.label_names, key)} {_number(value)}"
            for key, value in sorted(self.values.items())
        ]


class Gauge(_Metric):
    """A gauge read at scrape time from a callback returning ``{labels: value}``."""

    kind = "gauge"

    def __init__(
        self,
        name: str,
        help_text: str,
        read: Callable[[], Iterable[tuple[Labels, float]]],
        labels: Sequence[str] = (),
    ) -> None:
        super().__init__(name, help_text, labels)
        self.read = read

    def lines(self) -> list[str]:
        return [
            f"{self.name}{_labels(self.label_names, key)} {_number(value)}"
            for key, value in sorted(self.read())
        ]


class ReadCounter(Gauge):
    """A counter read at scrape time (from what a projector counts), like ``Gauge``."""

    kind = "counter"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        super().__init__(name, help_text, labels)
        self.buckets = tuple(sorted(buckets))
        #: labels → [count per bucket (+Inf last)], sum
        self.series: dict[Labels, tuple[list[int], list[float]]] = {}

    def observe(self, value: float, labels: Labels = ()) -> None:
        series = self.series.get(labels)
        if series is None:
            series = ([0] * (len(self.buckets) + 1), [0.0])
            self.series[labels] = series
        series[0][bisect.bisect_left(self.buckets, value)] += 1
        series[1][0] += value

    def lines(self) -> list[str]:
        out: list[str] = []
        for key, (counts, total) in sorted(self.series.items()):
            cumulative = 0
            for bound, count in zip((*self.buckets, math.inf), counts, strict=True):
                cumulative += count
                le = f'le="{_number(bound)}"'
                out.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {cumulative}")
            out.append(f"{self.name}_sum{_labels(self.label_names, key)} {_number(total[0])}")
            out.append(f"{self.name}_count{_labels(self.label_names, key)} {cumulative}")
        return out


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric: M) -> M:
        self.metrics.append(metric)
        return metric

    def exposition(self) -> str:
        lines: list[str] = []
        for metric in self.metrics:
            lines.extend(metric.header())
            lines.extend(metric.lines())
        return "\n".join(lines) + "\n"
