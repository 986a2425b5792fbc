"""Shared builders for the simulator tests: round-number profiles and one-call runs."""
from __future__ import annotations

from dataclasses import replace

from llmtower.engine.args import EngineArgs
from llmtower.sim.metrics import SLO
from llmtower.sim.profiles import DeviceProfile, load_model
from llmtower.sim.report import SimResult, build_result
from llmtower.sim.simulator import SimConfig, Simulator
from llmtower.sim.workload import TraceRequest

# A device with round numbers, so the tests can do the roofline arithmetic by hand.
ROUND_DEVICE = DeviceProfile(name="round", peak_flops=100e12, mem_bandwidth=1e12,
                             memory_bytes=40e9, compute_efficiency=0.5,
                             bandwidth_efficiency=0.8, step_overhead_s=0.001,
                             link_bandwidth=100e9, link_efficiency=1.0, link_latency_s=5e-6,
                             host_bandwidth=10e9)


def simulate(trace: list[TraceRequest], device="h100", model="llama-3-8b", slo=None,
             num_replicas=1, load_balancer="round_robin", tp=1, **engine_kw) -> SimResult:
    engine_kw.setdefault("seed", 0)
    cfg = SimConfig(engine=EngineArgs(**engine_kw), device=device, model=model,
                    tensor_parallel_size=tp, num_replicas=num_replicas,
                    load_balancer=load_balancer, slo=slo or SLO())
    return build_result(Simulator(cfg).run(trace))


def model(name="llama-3-8b"):
    return load_model(name)


def device_with(**changes) -> DeviceProfile:
    return replace(ROUND_DEVICE, **changes)
