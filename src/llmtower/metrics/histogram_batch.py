"""One value observed many times in a prometheus_client histogram, at the cost of one.

At saturation every stream of a step has the same inter-token latency (its previous output
went out with the previous step, at one timestamp), so the output handler observes each
distinct value once with its count instead of once per stream: a lock per bucket touched,
not per token. prometheus_client has no such call; this does what ``Histogram.observe``
does, ``count`` times at once (tests/metrics/test_histogram_batch.py holds the exposition
equal to repeated ``observe``).
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Any


def observe_repeated(histogram: Any, amount: float, count: int) -> None:
    """``histogram.observe(amount)`` ``count`` times (a labelled child or a bare histogram)."""
    if count <= 0:
        return
    if count == 1:
        histogram.observe(amount)
        return
    histogram._raise_if_not_observable()
    histogram._sum.inc(amount * count)
    # observe() puts the amount in the first bucket whose upper bound is >= it (+Inf last).
    i = bisect_left(histogram._upper_bounds, amount)
    if i < len(histogram._buckets):
        histogram._buckets[i].inc(count)
