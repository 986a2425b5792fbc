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
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections.abc import Callable

from llmtower.engine.arg_values import parse_bytes
from llmtower.engine.args import EngineArgs
from llmtower.sim.cluster import Replica, make_load_balancer
from llmtower.sim.cost_model import CostModel
from llmtower.sim.metrics import SLO, MetricsCollector
from llmtower.sim.profiles import DeviceProfile, ModelProfile, load_device, load_model
from llmtower.sim.prompts import PromptFactory
from llmtower.sim.shard import SIM_TOKEN, ReplicaShard, ReplicaTotals
from llmtower.sim.sharded import route_sharded
from llmtower.sim.workload import TraceRequest

__all__ = ["SIM_TOKEN", "SimConfig", "RunStats", "Simulator"]

DEFAULT_MAX_MODEL_LEN_CAP = 8192
# progress(simulated seconds, requests done); called every PROGRESS_EVERY requests.
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
    # Processes the replicas are split over (sharded.py); the results do not depend on it.
    workers: int = 1
    # > 0: route on the replicas' state as of the last multiple of this many simulated seconds
    # (the real head's stats snapshots; required by state-reading balancers when workers > 1).
    # 0: on their state at each arrival, in one process.
    routing_interval: float = 0.0
    # Apply runs of plain decode steps in one pass (shard.py): the same results, several
    # times faster. False simulates every step one by one (what the tests compare against).
    decode_runs: bool = True

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas={self.num_replicas} must be >= 1")
        make_load_balancer(self.load_balancer)
        if self.workers < 1:
            raise ValueError(f"workers={self.workers} must be >= 1")
        if self.routing_interval < 0:
            raise ValueError(f"routing_interval={self.routing_interval} must be >= 0 (seconds)")
        if (self.workers > 1 and self.routing_interval == 0
                and getattr(make_load_balancer(self.load_balancer), "uses_state", True)):
            raise ValueError(f"load_balancer={self.load_balancer!r} routes on the replicas' "
                             "state, which a run over several workers sees in snapshots: set "
                             "routing_interval > 0 (--routing-interval 0.5, the real head's "
                             "stats interval) or workers=1")


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
    replicas: list[ReplicaTotals]  # by index
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
        """Replay ``trace``; ``progress(simulated_now, num_done)`` is called every few
        thousand requests (for a progress bar) and once at the end (a run over workers counts
        the requests routed so far, the head does not see them finish)."""
        cfg = self.config
        with few_gc_passes():
            t0 = time.perf_counter()
            if cfg.workers == 1 and cfg.routing_interval == 0:
                metrics, totals, events = self._run(trace, progress)
            else:
                metrics, totals, events = route_sharded(
                    trace, self._balancer(), cfg.num_replicas, self._make_shard,
                    PromptFactory(cfg.engine.seed, cfg.prefix_len), cfg.workers,
                    cfg.routing_interval, progress)
            wall = time.perf_counter() - t0
        if progress is not None:
            progress(max((tl.t[-1] for tl in metrics.timelines if len(tl.t)), default=0.0),
                     len(trace))
        return RunStats(cfg, self.device, self.model, self.num_blocks, self.num_cpu_blocks,
                        self.max_model_len, trace, metrics, totals, wall, events)

    def _balancer(self):
        return make_load_balancer(self.config.load_balancer, self.cache_config.block_size)

    def _make_shard(self, indices: list[int], decode_runs: bool = True) -> ReplicaShard:
        cfg = self.config
        replicas = [Replica(i, self.scheduler_config, self.cache_config, self.cost_model)
                    for i in indices]
        shard = ReplicaShard(replicas, cfg.num_replicas, self.max_model_len,
                             cfg.oracle_output_len, self.scheduler_config.policy == "priority",
                             cfg.decode_runs and decode_runs)
        # The replicas' KV blocks (hundreds of thousands) live as long as the run: out of the
        # cycle collector's scans too (few_gc_passes unfreezes them at the end).
        gc.freeze()
        return shard

    def _run(self, trace: list[TraceRequest], progress: ProgressFn | None = None
             ) -> tuple[MetricsCollector, list[ReplicaTotals], int]:
        """One process, one heap, routing on the replicas' state at each arrival."""
        cfg = self.config
        balancer = self._balancer()
        prompts = PromptFactory(cfg.engine.seed, cfg.prefix_len)
        # A balancer that reads the replicas' state reads it at every arrival here: runs of
        # decode steps would be cut at every one of them, so they are not planned at all.
        shard = self._make_shard(list(range(cfg.num_replicas)),
                                 decode_runs=not getattr(balancer, "uses_state", True))
        replicas = list(shard.replicas.values())
        for i, tr in enumerate(trace):
            if progress is not None and i % PROGRESS_EVERY == 0 and i:
                progress(tr.arrival_time, i - shard.metrics.num_unfinished)
            shard.run_until(tr.arrival_time)  # steps that end before it see it arrive after
            ids = prompts.token_ids(tr)
            shard.add(tr, i, replicas[balancer.choose(replicas, ids)], ids)
        shard.run_to_end()
        return shard.metrics, shard.totals(), shard.num_events


@contextmanager
def few_gc_passes():
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
