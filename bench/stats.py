"""Percentiles and the markdown rows benchmarks print."""

from __future__ import annotations

import statistics


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; values need not be sorted."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99), "mean": statistics.fmean(values)}


def row(name: str, values: list[float]) -> str:
    s = summary(values)
    return f"| {name} | {s['p50']:.2f} | {s['p99']:.2f} | {s['mean']:.2f} | {s['n']} |"


def spread(values: list[float], spec: str = ".1f") -> str:
    """`median (min..max)` of `values`, each formatted with `spec`: a figure over repeats, as benchmarks print it."""
    return f"{format(statistics.median(values), spec)} ({format(min(values), spec)}..{format(max(values), spec)})"
