"""Measuring on a shared, noisy machine: interleave the systems being compared, report medians."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Interleaved:
    """Collects samples per (system, metric) while the caller runs A B A B ...; `median` reads them back."""

    def __init__(self):
        self.samples: dict[tuple[str, str], list[float]] = defaultdict(list)

    def add(self, system: str, metric: str, value: float) -> None:
        self.samples[(system, metric)].append(value)

    def median(self, system: str, metric: str) -> float | None:
        values = self.samples.get((system, metric))
        return statistics.median(values) if values else None

    def ratio(self, metric: str, a: str, b: str) -> float | None:
        x, y = self.median(a, metric), self.median(b, metric)
        return None if x is None or not y else x / y
