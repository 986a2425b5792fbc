"""The roofline step-time model, checked against arithmetic done by hand."""
from __future__ import annotations

from dataclasses import replace

import pytest
from sim_helpers import ROUND_DEVICE, device_with, model, simulate

from llmtower.sim.cost_model import CostModel
from llmtower.sim.profiles import load_device
from llmtower.sim.workload import TraceRequest


def test_single_request_latency_matches_the_roofline_by_hand():
    m = model("llama-3-8b")
    n_in, n_out = 200, 5
    res = simulate([TraceRequest(0.0, n_in, n_out)], device=ROUND_DEVICE, model=m,
                   enable_prefix_caching=False)
    # Llama-3-8B by hand: per layer q,o = 4096*4096 each, k,v = 4096*1024 each,
    # MLP 3*4096*14336; LM head 128256*4096; bf16; KV per token 2*32*8*128*2 bytes.
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    linear_flops = 2 * 32 * per_layer
    head_flops = 2 * 128256 * 4096
    attn_flops = 4 * 32 * 32 * 128  # per (query, key) pair
    weights_read = (32 * per_layer + 128256 * 4096) * 2
    kv_per_token = 2 * 32 * 8 * 128 * 2
    flops_s, bw = 100e12 * 0.5, 1e12 * 0.8

    def step(tokens, pairs, kv_read):
        compute = (tokens * linear_flops + head_flops + pairs * attn_flops) / flops_s
        memory = (weights_read + (kv_read + tokens) * kv_per_token) / bw
        return 0.001 + max(compute, memory)

    prefill = step(n_in, n_in * (n_in + 1) // 2, n_in)
    decodes = [step(1, n_in + k, n_in + k) for k in range(1, n_out)]
    r = res.requests
    assert r["ttft"][0] == pytest.approx(prefill, rel=1e-9)
    assert r["e2e"][0] == pytest.approx(prefill + sum(decodes), rel=1e-9)
    assert r["output_tokens"][0] == n_out
    assert res.summary["tpot_ms"]["mean"] == pytest.approx(1000 * sum(decodes) / (n_out - 1), rel=1e-9)


def test_memory_bound_decode_step_grows_with_the_kv_bytes_read():
    cm = CostModel(model("llama-3-8b"), load_device("h100"))
    batch = 64
    short = cm.cost(batch, batch, batch * 512, batch * 512, batch)
    long = cm.cost(batch, batch, batch * 4096, batch * 4096, batch)
    assert short.bound == "memory" and long.bound == "memory"
    extra_bytes = batch * (4096 - 512) * cm.model.kv_bytes_per_token
    assert long.total_s - short.total_s == pytest.approx(
        extra_bytes / cm.device.effective_bandwidth, rel=1e-9)
    assert long.total_s > 1.5 * short.total_s


def test_doubling_bandwidth_roughly_halves_decode_time():
    m = model("llama-3-8b")
    base = ROUND_DEVICE
    fast = replace(base, mem_bandwidth=2 * base.mem_bandwidth)
    batch, ctx = 32, 1024
    t1 = CostModel(m, base).step_time(batch, batch, batch * ctx, batch * ctx, batch)
    t2 = CostModel(m, fast).step_time(batch, batch, batch * ctx, batch * ctx, batch)
    overhead = base.step_overhead_s
    assert (t2 - overhead) == pytest.approx((t1 - overhead) / 2, rel=1e-9)
    # End to end, on a decode-heavy workload (one prefill step, then pure decodes): TPOT
    # falls to about half (the fixed step overhead keeps it a little above).
    trace = [TraceRequest(0.0, 64, 64, request_id=str(i)) for i in range(16)]
    slow_run = simulate(trace, device=base, model=m)
    fast_run = simulate(trace, device=fast, model=m)
    ratio = fast_run.summary["tpot_ms"]["mean"] / slow_run.summary["tpot_ms"]["mean"]
    assert 0.5 <= ratio < 0.6


def test_prefill_is_compute_bound_and_linear_in_tokens():
    cm = CostModel(model("llama-3-8b"), load_device("h100"))
    a = cm.cost(2048, 1, 2048 * 2049 // 2, 2048)
    assert a.bound == "compute"
    b = cm.cost(4096, 1, 0, 0)
    c = cm.cost(8192, 1, 0, 0)
    assert c.compute_s - b.compute_s == pytest.approx(4096 * cm.s_per_token, rel=1e-9)


def test_tensor_parallelism_splits_work_and_adds_all_reduce_time():
    m = model("llama-3-70b")
    one = CostModel(m, load_device("h100"), 1)
    two = CostModel(m, load_device("h100"), 2)
    c1, c2 = one.cost(512, 4, 0, 4096), two.cost(512, 4, 0, 4096)
    assert c2.compute_s == pytest.approx(c1.compute_s / 2)
    assert c1.comm_s == 0 and c2.comm_s > 0
    # 2 all-reduces per layer, ring over 2 ranks moves the whole buffer once.
    dev = load_device("h100")
    link = dev.link_bandwidth * dev.link_efficiency
    expected = 2 * 80 * (dev.link_latency_s + 512 * 8192 * 2 / link)
    assert c2.comm_s == pytest.approx(expected, rel=1e-9)


def test_kv_capacity_comes_from_memory_left_after_weights():
    m = model("llama-3-8b")
    cm = CostModel(m, device_with(memory_bytes=40e9), 1, block_size=16)
    expected = int((40e9 * 0.9 - m.weight_bytes) // (16 * m.kv_bytes_per_token))
    assert cm.num_kv_blocks(0.9) == expected


def test_a_model_that_does_not_fit_says_which_tensor_parallel_size_would():
    with pytest.raises(ValueError, match=r"141.1 GB .* use --tensor-parallel-size 4"):
        CostModel(model("llama-3-70b"), load_device("h100"), 1).num_kv_blocks(0.9)
    assert CostModel(model("llama-3-70b"), load_device("h100"), 4).num_kv_blocks(0.9) > 10_000


def test_tensor_parallel_size_must_divide_the_heads():
    with pytest.raises(ValueError, match="num_heads"):
        CostModel(model("smollm2-135m"), load_device("h100"), 2)


def test_an_additive_device_adds_compute_and_memory_time():
    m = model("llama-3-8b")
    mx = CostModel(m, ROUND_DEVICE).cost(64, 64, 64 * 500, 64 * 500, 64)
    add = CostModel(m, replace(ROUND_DEVICE, overlap="sum"))
    c = add.cost(64, 64, 64 * 500, 64 * 500, 64)
    assert c.total_s == pytest.approx(c.overhead_s + c.compute_s + c.memory_s)
    assert add.step_time(64, 64, 64 * 500, 64 * 500, 64) == pytest.approx(c.total_s)
    assert c.total_s > mx.total_s
    with pytest.raises(ValueError, match="overlap"):
        replace(ROUND_DEVICE, overlap="both")
