"""Metric definitions shared with `vllm bench serve`."""
from __future__ import annotations

import numpy as np
import pytest

from llmtower.sim.metrics import SLO, latency_stats, meets_slo, tpot_seconds, weighted_latency_stats


def test_weighted_stats_equal_the_stats_of_the_expanded_values():
    rng = np.random.default_rng(0)
    values = rng.random(50)
    counts = rng.integers(1, 20, 50)
    expanded = np.repeat(values, counts)
    w = weighted_latency_stats(values, counts)
    assert w["mean"] == pytest.approx(expanded.mean() * 1000)
    assert w["std"] == pytest.approx(expanded.std() * 1000)
    assert w["median"] == pytest.approx(np.percentile(expanded, 50, method="inverted_cdf") * 1000)
    assert w["p99"] == pytest.approx(np.percentile(expanded, 99, method="inverted_cdf") * 1000)


def test_tpot_skips_single_token_requests():
    ttft = np.array([0.1, 0.2])
    e2e = np.array([1.1, 0.2])
    out = np.array([11, 1])
    assert tpot_seconds(ttft, e2e, out).tolist() == pytest.approx([0.1])
    assert np.isnan(latency_stats(np.zeros(0))["mean"])


def test_slo_parsing_and_checking():
    slo = SLO.parse(["ttft:200", "tpot:50", "e2el:1000"])
    assert (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms) == (200, 50, 1000)
    ttft, e2e, out = np.array([0.1, 0.3, 0.1]), np.array([0.5, 0.5, 2.0]), np.array([10, 10, 10])
    ok = meets_slo(slo, ttft, e2e, out)
    assert ok.tolist() == [True, False, False]
    for bad in ("ttft", "latency:5", "tpot:-1"):
        with pytest.raises(ValueError, match="ttft:MS"):
            SLO.parse([bad])
