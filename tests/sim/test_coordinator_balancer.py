"""The simulator's 'coordinator' balancer is the real head's router: with prompts that share
system prompts and KV caches too small to hold all of them everywhere, its prefix affinity
raises the prefix-cache hit rate over plain least-loaded routing."""
from __future__ import annotations

from sim_helpers import simulate

from llmtower.sim.workload_gen import WorkloadSpec, generate


def test_prefix_affinity_raises_the_hit_rate_on_shared_system_prompts():
    trace = generate(WorkloadSpec(num_requests=400, rate=40.0, num_prefix_groups=32,
                                  prefix_len=512, seed=2))
    kw = dict(num_replicas=4, num_gpu_blocks=700)
    plain = simulate(trace, load_balancer="least_loaded", **kw).summary
    no_prefix = simulate(trace, load_balancer="coordinator_no_prefix", **kw).summary
    coord = simulate(trace, load_balancer="coordinator", **kw).summary
    assert coord["completed"] == plain["completed"] == 400
    assert coord["prefix_cache_hit_rate"] > 1.3 * plain["prefix_cache_hit_rate"]
    assert coord["prefix_cache_hit_rate"] > 1.3 * no_prefix["prefix_cache_hit_rate"]
