"""The timing harness of the timing benches: side-by-side samples in one process, order rotated, min / median.

The machine these benches run on is shared, so a ratio of two timings is only meaningful when both were taken
under the same load: :func:`interleaved` runs every candidate once per round, in an order rotated by one each
round (A B C, B C A, C A B, ...), so a change of load lands on all candidates alike and none is always first
after a slow neighbour. Each call is timed in wall seconds and in process CPU seconds (which excludes time spent
descheduled; cleanest with one torch thread), with the garbage collector off. :func:`summary` gives min and median
per candidate; :func:`ratio` gives min/min (contention only ever adds time, so the minima estimate the uncontended
cost) and the median of the per-round ratios (robust to load drifting between rounds).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Sample:
    wall_s: float
    cpu_s: float
    value: object = None  # what the call returned (e.g. a decode's results, to check tokens and count NFE)


@dataclass
class Timings:
    """Every sample of every candidate, in run order, and the order each round used."""

    samples: dict[str, list[Sample]] = field(default_factory=dict)
    orders: list[list[str]] = field(default_factory=list)

    def seconds(self, name: str, clock: str = "cpu", per: Callable[[Sample], float] | None = None) -> list[float]:
        """The samples of ``name`` on ``clock`` ('cpu' or 'wall'), each divided by ``per(sample)`` if given."""
        out = []
        for s in self.samples[name]:
            t = s.cpu_s if clock == "cpu" else s.wall_s
            out.append(t / per(s) if per is not None else t)
        return out


def rotated(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: ``names`` rotated left by r."""
    k = r % len(names)
    return names[k:] + names[:k]


def interleaved(candidates: dict[str, Callable[[], object]], rounds: int, warmup: int = 0,
                between: Callable[[], None] | None = None) -> Timings:  # fmt: skip
    """Run each candidate ``rounds`` times, one call of each per round in a rotated order (:func:`rotated`),
    after ``warmup`` untimed rounds; ``between`` runs untimed after every call (e.g. a device sync)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1; got {rounds}")
    names = list(candidates)
    out = Timings({n: [] for n in names})
    enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(warmup + rounds):
            order = rotated(names, r)
            if r >= warmup:
                out.orders.append(order)
            for name in order:
                c0, t0 = time.process_time(), time.perf_counter()
                value = candidates[name]()
                if between is not None:
                    between()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if r >= warmup:
                    out.samples[name].append(Sample(wall, cpu, value))
    finally:
        if enabled:
            gc.enable()
    return out


def summary(xs: list[float]) -> dict:
    """min, median, max and the number of samples."""
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def ratio(num: list[float], den: list[float]) -> dict:
    """``num / den`` of paired samples (same rounds): min / min and the median of the per-round ratios."""
    if len(num) != len(den) or not num:
        raise ValueError(f"ratio needs paired samples; got {len(num)} and {len(den)}")
    return {"of_min": min(num) / min(den), "median_of_rounds": statistics.median(a / b for a, b in zip(num, den,
                                                                                                      strict=True))}
