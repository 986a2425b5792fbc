"""observe_repeated: a value observed n times at once leaves the histogram exactly as n
observe() calls do (buckets, count, sum), bucket bounds and +Inf included."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from llmtower.metrics.histogram_batch import observe_repeated

BUCKETS = [0.01, 0.1, 1.0]


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    """name{le} -> value, without the creation timestamp (which differs between registries)."""
    return {f"{s.name}{s.labels.get('le', '')}": s.value for m in registry.collect()
            for s in m.samples if not s.name.endswith("_created")}


def _assert_same(ra: CollectorRegistry, rb: CollectorRegistry) -> None:
    a, b = _samples(ra), _samples(rb)
    assert a.keys() == b.keys()
    for k in a:  # the sum is added once (value * count), not count times: rounding only
        assert b[k] == pytest.approx(a[k], rel=1e-12), k


def _pair():
    ra, rb = CollectorRegistry(), CollectorRegistry()
    a = Histogram("itl", "h", ["engine"], buckets=BUCKETS, registry=ra).labels("0")
    b = Histogram("itl", "h", ["engine"], buckets=BUCKETS, registry=rb).labels("0")
    return (ra, a), (rb, b)


@pytest.mark.parametrize("value", [0.0, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 1e9])
@pytest.mark.parametrize("count", [1, 2, 7])
def test_repeated_equals_one_observe_per_count(value, count):
    (ra, a), (rb, b) = _pair()
    for _ in range(count):
        a.observe(value)
    observe_repeated(b, value, count)
    _assert_same(ra, rb)


def test_mixed_values_and_a_zero_count():
    (ra, a), (rb, b) = _pair()
    for value, count in [(0.02, 3), (0.3, 5), (4.0, 1), (0.02, 0)]:
        for _ in range(count):
            a.observe(value)
        observe_repeated(b, value, count)
    _assert_same(ra, rb)
    got = _samples(rb)
    assert got["itl_count"] == 9 and got["itl_bucket+Inf"] == 9
    assert got["itl_bucket0.1"] == 3 and got["itl_bucket1.0"] == 8
