"""The CPU profile fit recovers a known device from step times it generated."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from llmtower.sim.calibrate import StepSample, fit_device
from llmtower.sim.cost_model import CostModel
from llmtower.sim.profiles import DeviceProfile, load_model


def synthetic_samples(device, model, noise=0.0, seed=0):
    cm = CostModel(model, device)
    rng = random.Random(seed)
    out = []
    for ctx in (32, 256, 1024):
        for batch in (1, 4, 16, 48):
            for prefill in (0, 16, 128, 512):
                tokens = batch + prefill
                pairs = batch * ctx + prefill * (prefill + 1) // 2
                kv = batch * ctx + prefill
                seqs = batch + (1 if prefill else 0)
                t = cm.step_time(tokens, seqs, pairs, kv, seqs)
                out.append(StepSample(tokens, seqs, pairs, kv, seqs,
                                      t * (1 + noise * rng.uniform(-1, 1))))
    return out


TRUE = DeviceProfile(name="truth", peak_flops=60e9, mem_bandwidth=8e9, memory_bytes=8e9,
                     compute_efficiency=1.0, bandwidth_efficiency=1.0, step_overhead_s=0.004,
                     seq_overhead_s=50e-6)


def test_the_fit_recovers_the_device_that_generated_the_steps():
    w1 = load_model("w1")
    prof, report = fit_device(synthetic_samples(TRUE, w1), w1, memory_bytes=8e9)
    assert prof.peak_flops == pytest.approx(TRUE.peak_flops, rel=0.02)
    assert prof.mem_bandwidth == pytest.approx(TRUE.mem_bandwidth, rel=0.02)
    assert prof.step_overhead_s == pytest.approx(TRUE.step_overhead_s, rel=0.05)
    assert prof.seq_overhead_s == pytest.approx(TRUE.seq_overhead_s, rel=0.1)
    assert report["max_abs_rel_err"] < 0.01
    assert report["overlap"] == prof.overlap == "max"
    assert 0 < report["memory_bound_points"] < report["points"]


def test_the_fit_tells_overlapping_from_alternating_compute_and_memory():
    w1 = load_model("w1")
    additive = replace(TRUE, overlap="sum")
    prof, report = fit_device(synthetic_samples(additive, w1), w1, memory_bytes=8e9)
    assert prof.overlap == "sum" and report["max_abs_rel_err"] < 0.01
    assert prof.peak_flops == pytest.approx(TRUE.peak_flops, rel=0.02)
    assert prof.mem_bandwidth == pytest.approx(TRUE.mem_bandwidth, rel=0.02)
    assert report["rms_rel_err_by_form"]["max"] > 10 * report["rms_rel_err_by_form"]["sum"]
    forced, _ = fit_device(synthetic_samples(additive, w1), w1, memory_bytes=8e9, overlap="max")
    assert forced.overlap == "max"


def test_the_fit_tolerates_noise_and_outliers():
    w1 = load_model("w1")
    samples = synthetic_samples(TRUE, w1, noise=0.05, seed=1)
    for s in samples[::9]:  # another process stole the CPU during these steps
        s.seconds *= 3
    prof, report = fit_device(samples, w1, memory_bytes=8e9)
    assert prof.peak_flops == pytest.approx(TRUE.peak_flops, rel=0.1)
    assert prof.mem_bandwidth == pytest.approx(TRUE.mem_bandwidth, rel=0.1)
    assert report["points_used"] < report["points"]


def test_too_few_points_is_a_clear_error():
    with pytest.raises(ValueError, match="at least 4"):
        fit_device([], load_model("w1"))
