"""A tiny Prometheus text-format registry: counters, gauges and histograms.

The engine loop updates them (it is the only writer, on the event loop thread); /metrics
renders them. Gauges may be callables read at scrape time so they never go stale.
"""

from __future__ import annotations

import bisect
from typing import Callable

# Latency buckets in seconds: 1 ms .. 60 s, roughly x2.5 apart.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in labels.items())
    return "{" + inner + "}"


class Counter:
    """A counter we increment, or (fn) one another component keeps, read at scrape time.
    `name` is without the `_total` suffix, which the family (HELP/TYPE) and samples carry."""
    kind = "counter"

    def __init__(self, name: str, help: str, fn: Callable[[], float] | None = None):
        if name.endswith("_total"):
            raise ValueError(f"counter {name!r}: give the name without _total")
        self.name, self.help, self.fn = name, help, fn
        self.family = name + "_total"
        self.values: dict[tuple, float] = {}

    def inc(self, amount: float = 1.0, **labels) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def samples(self):
        if self.fn is not None:
            yield self.name + "_total", {}, self.fn()
            return
        for key, v in (self.values or {(): 0.0}).items():
            yield self.name + "_total", dict(key), v


class Gauge:
    kind = "gauge"

    def __init__(self, name: str, help: str, fn: Callable[[], float] | None = None):
        self.name, self.help, self.fn = name, help, fn
        self.family = name
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = value

    def samples(self):
        yield self.name, {}, self.fn() if self.fn else self.value


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets=LATENCY_BUCKETS):
        self.name, self.help = name, help
        self.family = name
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def samples(self):
        acc = 0
        for bound, n in zip(self.buckets + (float("inf"),), self.counts):
            acc += n
            yield self.name + "_bucket", {"le": _fmt(bound)}, acc
        yield self.name + "_sum", {}, self.sum
        yield self.name + "_count", {}, self.count


class Registry:
    def __init__(self):
        self.metrics: list = []

    def add(self, metric):
        self.metrics.append(metric)
        return metric

    def render(self) -> bytes:
        lines = []
        for m in self.metrics:
            # The family is named as its samples are (a counter's with _total), so Prometheus'
            # parsers attach the samples to it.
            lines.append(f"# HELP {m.family} {m.help}")
            lines.append(f"# TYPE {m.family} {m.kind}")
            for name, labels, value in m.samples():
                lines.append(f"{name}{_labels(labels)} {_fmt(value)}")
        return ("\n".join(lines) + "\n").encode()
