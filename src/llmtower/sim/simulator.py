"""The discrete-event simulation: a trace's arrivals and the replicas' step completions,
processed in virtual-time order from one heap.

  arrival at t ──▶ load balancer ──▶ replica.pending ──(next step boundary)──▶ Scheduler
  step start at t: add pending requests, schedule(), SimExecutor advances the replica's
                   clock by the predicted step time, push "step done at t + dt"
  step done at t:  update_from_output() (tokens stamped t), record metrics, start the next step

Arrivals are processed before a step that starts at the same instant, so requests that
arrive together are scheduled together. Each replica runs on its own clock; the heap keeps
all of them consistent with the global order of events.
"""
from __future__ import annotations

import gc
import heapq
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections.abc import Callable

from llmtower.core.errors import AdmissionError, QueueFullError
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs, parse_bytes
from llmtower.sim.cluster import Replica, make_load_balancer
from llmtower.sim.cost_model import CostModel
from llmtower.sim.metrics import SLO, MetricsCollector
from llmtower.sim.profiles import DeviceProfile, ModelProfile, load_device, load_model
from llmtower.sim.prompts import PromptFactory
from llmtower.sim.workload import TraceRequest

DEFAULT_MAX_MODEL_LEN_CAP = 8192
# progress(simulated seconds, requests done); called every PROGRESS_EVERY events.
ProgressFn = Callable[[float, int], None]
PROGRESS_EVERY = 4096


@dataclass
class SimConfig:
    """Owns everything one simulation run depends on besides its trace: the engine settings
    (the same EngineArgs the real engine takes), the hardware and model profiles and the
    cluster shape.

    ``kv_cache_memory`` is per tensor-parallel rank; None sizes the KV cache as vLLM does:
    ``gpu_memory_utilization`` of the device's memory minus the rank's share of the weights.
    ``engine.num_gpu_blocks`` > 0 overrides both. ``engine.swap_space`` is per rank too.
    """

    engine: EngineArgs = field(default_factory=EngineArgs)
    device: str | DeviceProfile = "h100"
    model: str | ModelProfile = "llama-3-8b"
    tensor_parallel_size: int = 1
    num_replicas: int = 1
    load_balancer: str = "round_robin"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: str | None = None
    prefix_len: int = 256  # shared-prefix length for trace lines without their own
    slo: SLO = field(default_factory=SLO)
    # True: each request's max_tokens is its true output length (the scheduler, SJF and the
    # `remaining` victim rule see the oracle). False: max_tokens is left open (up to the
    # context) and the request ends with an EOS at its length, as real requests do; SJF then
    # relies on its online predictor.
    oracle_output_len: bool = True

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas={self.num_replicas} must be >= 1")
        make_load_balancer(self.load_balancer)


@dataclass
class RunStats:
    """Owns the raw outcome of one run, before it is summarized."""

    config: SimConfig
    device: DeviceProfile
    model: ModelProfile
    num_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    trace: list[TraceRequest]
    metrics: MetricsCollector
    replicas: list[Replica]
    wall_s: float
    num_events: int


class Simulator:
    """Owns one run: the profiles and cost model, the replicas with their schedulers, the load
    balancer, the event heap and the metrics collector."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        eng = config.engine
        self.device = (config.device if isinstance(config.device, DeviceProfile)
                       else load_device(config.device))
        self.model = (config.model if isinstance(config.model, ModelProfile)
                      else load_model(config.model))
        self.cost_model = CostModel(self.model, self.device, config.tensor_parallel_size,
                                    eng.block_size)
        self.max_model_len = eng.max_model_len or min(self.model.max_position_embeddings,
                                                      DEFAULT_MAX_MODEL_LEN_CAP)
        if eng.num_gpu_blocks:
            self.num_blocks = eng.num_gpu_blocks
        else:
            kv = parse_bytes(config.kv_cache_memory) if config.kv_cache_memory else None
            self.num_blocks = self.cost_model.num_kv_blocks(config.gpu_memory_utilization, kv)
        self.num_cpu_blocks = (self.cost_model.num_swap_blocks(parse_bytes(eng.swap_space))
                               if eng.preemption_mode == "swap" else 0)
        self.scheduler_config = eng.create_scheduler_config(self.max_model_len)
        self.cache_config = eng.create_cache_config(self.num_blocks, self.num_cpu_blocks)

    def run(self, trace: list[TraceRequest], progress: ProgressFn | None = None) -> RunStats:
        """Replay ``trace``; ``progress(simulated_now, num_finished)`` is called every few
        thousand events (for a progress bar) and once at the end."""
        cfg = self.config
        replicas = [Replica(i, self.scheduler_config, self.cache_config, self.cost_model)
                    for i in range(cfg.num_replicas)]
        with _few_gc_passes():
            return self._run(trace, replicas, progress)

    def _run(self, trace: list[TraceRequest], replicas: list[Replica],
             progress: ProgressFn | None = None) -> RunStats:
        cfg = self.config
        balancer = make_load_balancer(cfg.load_balancer)
        metrics = MetricsCollector(cfg.num_replicas)
        prompts = PromptFactory(cfg.engine.seed, cfg.prefix_len)
        use_priority = self.scheduler_config.policy == "priority"
        params: dict[int, SamplingParams] = {}
        oracle = cfg.oracle_output_len
        heap: list[tuple[float, int, int]] = []  # (time, sequence, replica): step boundaries
        wake = [False] * len(replicas)  # a step-start event is in the heap
        seq = 0
        i, n = 0, len(trace)
        events = 0
        t0 = time.perf_counter()
        while i < n or heap:
            events += 1
            if progress is not None and events % PROGRESS_EVERY == 0:
                now = heap[0][0] if heap else trace[i].arrival_time
                progress(now, i - metrics.num_unfinished)
            if i < n and (not heap or trace[i].arrival_time <= heap[0][0]):
                tr = trace[i]
                ids = prompts.token_ids(tr)
                rep = replicas[balancer.choose(replicas, ids)]
                sp = params.get(tr.output_len)
                if sp is None:
                    sp = params[tr.output_len] = _sampling_params(tr.output_len, oracle)
                if not oracle and len(ids) + tr.output_len > self.max_model_len:
                    sp = _sampling_params(max(1, self.max_model_len - len(ids)), False)
                rep.pending.append(Request(tr.request_id, ids, sp,
                                           eos_token_id=None if oracle else SIM_TOKEN,
                                           priority=tr.priority if use_priority else 0,
                                           arrival_time=tr.arrival_time, tenant=tr.tenant))
                metrics.on_submit(tr.request_id, i, tr.arrival_time)
                if rep.in_flight is None and not wake[rep.index]:
                    wake[rep.index] = True
                    heapq.heappush(heap, (tr.arrival_time, seq, rep.index))
                    seq += 1
                i += 1
                continue
            t, _, ri = heapq.heappop(heap)
            rep = replicas[ri]
            wake[ri] = False
            if rep.in_flight is not None:
                so, mro = rep.in_flight
                rep.in_flight = None
                outs = rep.scheduler.update_from_output(so, mro)
                metrics.on_outputs(outs.outputs, t, ri)
            if self._start_step(rep, t, metrics):
                heapq.heappush(heap, (rep.clock.now, seq, ri))
                seq += 1
        if progress is not None:
            progress(max((r.clock.now for r in replicas), default=0.0), n - metrics.num_unfinished)
        return RunStats(cfg, self.device, self.model, self.num_blocks, self.num_cpu_blocks,
                        self.max_model_len, trace, metrics, replicas,
                        time.perf_counter() - t0, events)

    @staticmethod
    def _start_step(rep: Replica, t: float, metrics: MetricsCollector) -> bool:
        """Take the replica's pending arrivals, schedule and execute one step; False when it
        has nothing it can run (it then idles until its next arrival)."""
        rep.clock.advance_to(t)
        sched = rep.scheduler
        if rep.pending:
            for req in rep.pending:
                try:
                    sched.add_request(req)
                except (AdmissionError, QueueFullError) as e:
                    metrics.on_rejected(req.request_id, str(e))
            rep.pending.clear()
        if not sched.requests:
            return False
        so = sched.schedule()
        usage = sched.kv.usage()
        if usage > rep.peak_kv_usage:
            rep.peak_kv_usage = usage
        metrics.on_step(rep.index, t, len(sched.waiting), len(sched.running), len(sched.swapped),
                        usage)
        if so.total_num_scheduled_tokens == 0 and not so.blocks_to_swap_out:
            rep.executor.forget(so.finished_req_ids)
            return False
        rep.in_flight = (so, rep.executor.execute_model(so))
        return True


# The token the simulated executor samples every time; the EOS of requests whose output
# length is hidden (oracle_output_len=False), which may stop only after min_tokens.
SIM_TOKEN = 1


def _sampling_params(output_len: int, oracle: bool) -> SamplingParams:
    if oracle:
        return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    return SamplingParams(max_tokens=None, min_tokens=output_len, temperature=0.0)


@contextmanager
def _few_gc_passes():
    """Collect garbage less often while a run lasts. A run allocates a few objects per request
    and step, nearly all freed by reference counting; with the default gen-0 threshold the
    cycle collector would also rescan the hundreds of thousands of long-lived KV blocks and
    trace entries again and again (about 20% of a large run). Those are frozen out of the
    scans, and the previous settings come back afterwards."""
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(old[0], 20_000), old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()
