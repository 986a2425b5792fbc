"""Data-parallel replicas, each with its own real Scheduler, behind a load balancer."""
from __future__ import annotations

from collections.abc import Callable

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.outputs import ModelRunnerOutput, SchedulerOutput
from llmtower.core.request import Request
from llmtower.core.sched.scheduler import Scheduler
from llmtower.distributed.routing import EngineLoad, Router
from llmtower.sim.clock import VirtualClock
from llmtower.sim.cost_model import CostModel
from llmtower.sim.sim_executor import SimExecutor


class Replica:
    """Owns one engine replica: a real ``Scheduler`` on the replica's own virtual clock, its
    ``SimExecutor``, the arrivals it will take at its next step boundary (a real EngineCore also
    takes new requests only between steps) and the step in flight."""

    def __init__(self, index: int, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 cost_model: CostModel) -> None:
        self.index = index
        self.clock = VirtualClock()
        self.scheduler = Scheduler(scheduler_config, cache_config, clock=self.clock)
        self.executor = SimExecutor(cost_model, self.clock)
        self.pending: list[Request] = []
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.peak_kv_usage = 0.0

    @property
    def busy(self) -> bool:
        return self.in_flight is not None

    @property
    def load(self) -> int:
        """Requests this replica owes an answer: queued at it or inside its scheduler."""
        return len(self.pending) + len(self.scheduler.requests)


class RoundRobin:
    """Owns the next replica index: requests go to replicas in turn."""

    uses_state = False  # routes on the index alone: a sharded run routes it up front

    def __init__(self) -> None:
        self._next = 0

    def choose(self, replicas: list[Replica], _token_ids: list[int] | None = None) -> int:
        i = self._next
        self._next = (i + 1) % len(replicas)
        return i


class LeastLoaded:
    """Sends each request to the replica with the fewest unfinished requests (lowest index on
    a tie), as a client that sees every engine's queue would."""

    def choose(self, replicas: list[Replica], _token_ids: list[int] | None = None) -> int:
        best, best_load = 0, replicas[0].load
        for r in replicas[1:]:
            load = r.load
            if load < best_load:
                best, best_load = r.index, load
        return best

    def choose_loads(self, loads: list[EngineLoad], _token_ids: list[int] | None = None) -> int:
        """The same rule on reported loads (a sharded run's head)."""
        best, best_load = 0, loads[0].in_flight
        for i in range(1, len(loads)):
            if loads[i].in_flight < best_load:
                best, best_load = i, loads[i].in_flight
        return best


class Coordinator:
    """The real data-parallel coordinator's rule (``distributed/routing.py``): each replica's
    load from its queues and KV usage, with prefix affinity unless ``prefix_aware`` is off.
    The simulator sees the replicas' state at once where the real head sees snapshots up to
    half a second old."""

    def __init__(self, block_size: int, prefix_aware: bool = True) -> None:
        self.router = Router(block_size, prefix_aware=prefix_aware)
        self.prefix_aware = prefix_aware

    def choose(self, replicas: list[Replica], token_ids: list[int] | None = None) -> int:
        loads = [EngineLoad(in_flight=r.load, waiting=len(r.scheduler.waiting),
                            running=len(r.scheduler.running), kv_usage=r.scheduler.kv.usage())
                 for r in replicas]
        return self.router.choose(loads, token_ids)

    def choose_loads(self, loads: list[EngineLoad], token_ids: list[int] | None = None) -> int:
        """The same rule on reported loads (a sharded run's head)."""
        return self.router.choose(loads, token_ids)


# name -> factory(block size of the replicas' KV cache, which prefix affinity hashes by)
LOAD_BALANCERS: dict[str, Callable[[int], object]] = {
    "round_robin": lambda _bs: RoundRobin(),
    "least_loaded": lambda _bs: LeastLoaded(),
    "coordinator": lambda bs: Coordinator(bs),
    "coordinator_no_prefix": lambda bs: Coordinator(bs, prefix_aware=False),
}


def make_load_balancer(name: str, block_size: int = 16):
    try:
        return LOAD_BALANCERS[name](block_size)
    except KeyError:
        raise ValueError(f"load_balancer={name!r} is invalid: use one of "
                         f"{', '.join(LOAD_BALANCERS)}") from None
