"""Synthetic workloads: arrivals, lengths, mixes and shared prefixes, all from one seed."""
from __future__ import annotations

import numpy as np
import pytest

from llmtower.sim.prompts import PromptFactory
from llmtower.sim.workload import TraceRequest
from llmtower.sim.workload_gen import LengthDist, WorkloadSpec, generate


def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    spec = dict(num_requests=200, rate=10.0, input_len="sharegpt", output_len="uniform:1-50",
                priority_mix="0:1,1:1", tenants="a:1,b:2", num_prefix_groups=3)
    assert generate(WorkloadSpec(**spec, seed=1)) == generate(WorkloadSpec(**spec, seed=1))
    assert generate(WorkloadSpec(**spec, seed=1)) != generate(WorkloadSpec(**spec, seed=2))


def test_poisson_arrivals_have_the_requested_rate_and_gamma_is_burstier():
    poisson = [r.arrival_time for r in generate(WorkloadSpec(num_requests=20000, rate=50.0))]
    gaps = np.diff(poisson)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff([r.arrival_time for r in generate(
        WorkloadSpec(num_requests=20000, rate=50.0, burstiness=0.25))])
    assert bursty.mean() == pytest.approx(1 / 50, rel=0.1)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # gamma: CV 1/sqrt(k)
    assert all(r.arrival_time == 0 for r in generate(WorkloadSpec(num_requests=5)))


def test_length_specs():
    rng = np.random.default_rng(0)
    assert set(LengthDist.parse("7").sample(rng, 10)) == {7}
    u = LengthDist.parse("uniform:3-5").sample(rng, 1000)
    assert set(u) == {3, 4, 5}
    out = LengthDist.parse("sharegpt", "output").sample(rng, 50000)
    assert 4 <= out.min() and out.max() <= 2048
    assert out.mean() == pytest.approx(338, rel=0.1)  # ShareGPT's published output mean
    assert np.percentile(out, 99) > 5 * np.median(out)  # a heavy tail
    for bad in ("uniform:5-3", "zero", "0", "lognormal:10"):
        with pytest.raises(ValueError, match="uniform:LO-HI"):
            LengthDist.parse(bad)


def test_mixes_follow_their_weights():
    t = generate(WorkloadSpec(num_requests=4000, priority_mix="0:1,5:3", tenants="a:1,b:1"))
    prios = np.array([r.priority for r in t])
    assert set(prios) == {0, 5} and (prios == 5).mean() == pytest.approx(0.75, abs=0.03)
    assert {r.tenant for r in t} == {"a", "b"}
    with pytest.raises(ValueError, match="VALUE:WEIGHT"):
        generate(WorkloadSpec(num_requests=4, priority_mix="high:1"))


def test_requests_of_a_prefix_group_share_their_prefix_only():
    trace = generate(WorkloadSpec(num_requests=40, num_prefix_groups=2, prefix_len=32,
                                  input_len="uniform:8-16"))
    f = PromptFactory(seed=0)
    prompts = [(r.prefix_group, f.token_ids(r)) for r in trace]
    for group, ids in prompts:
        assert len(ids) >= 40
        for g2, ids2 in prompts:
            if ids2 is not ids:
                assert (ids[:32] == ids2[:32]) == (group == g2)
                assert ids[32:40] != ids2[32:40]
    assert PromptFactory(0).token_ids(trace[0]) == PromptFactory(0).token_ids(trace[0])
    explicit = TraceRequest(0, 3, 1, prompt_token_ids=[9, 8, 7])
    assert f.token_ids(explicit) == [9, 8, 7]
