"""One simulation over several worker processes: the replicas split into shards, each shard
advanced by one process, the routing decided at the head.

  head: trace ─▶ prompts ─▶ load balancer ─▶ arrivals per shard ──pipe──▶ worker w:
        (reads the replicas' reported state                               ReplicaShard of
         at window boundaries, if it needs any)  ◀── states at t ──────── replicas r ≡ w mod W

Replicas interact only through routing (``shard.py``), so this is exact:

- A balancer that ignores the replicas' state (``round_robin``) routes the whole trace up
  front; the shards never wait for each other, and every replica sees exactly the arrivals and
  steps of the single-heap run: the results are identical to ``Simulator`` in one process.
- A balancer that reads their state (``least_loaded``, ``coordinator``) routes in windows of
  ``routing_interval`` simulated seconds, as the real head does with the engines' stats
  snapshots: the arrivals of a window are routed on every replica's state at the window's
  start (its queues and KV usage) plus the requests sent to it since, which the head counts
  itself. Every worker advances to the window's start and reports; that is the lock-step.
  The outcome depends on the interval, never on the number of workers: 1 worker (in this
  process) and N give identical results for a seed.
"""
from __future__ import annotations

import math
import multiprocessing as mp
from collections.abc import Callable
from typing import Any

from llmtower.distributed.routing import EngineLoad
from llmtower.sim.metrics import MetricsCollector
from llmtower.sim.prompts import PromptFactory
from llmtower.sim.shard import ReplicaShard, ReplicaState, ReplicaTotals
from llmtower.sim.workload import TraceRequest

# Arrivals per message when routing needs no state: bounds the head's memory and lets the
# workers start while the head still routes.
CHUNK = 4096

# One arrival as sent to a shard: trace index, replica, prompt ids (bytes where generated:
# they pickle at C speed).
Arrival = tuple[int, int, "bytes | list[int]"]
ProgressFn = Callable[[float, int], None]


class ShardRunner:
    """Owns a ``ReplicaShard`` and applies the head's messages to it (in a worker process, or
    in the head's own process for a 1-worker run)."""

    def __init__(self, shard: ReplicaShard, trace: list[TraceRequest]) -> None:
        self.shard = shard
        self.trace = trace

    def advance(self, arrivals: list[Arrival], until: float | None
                ) -> dict[int, ReplicaState] | None:
        """Deliver ``arrivals``; with ``until``, run every step before it and report the
        replicas' state at ``until``."""
        shard, trace = self.shard, self.trace
        for ti, ri, _ in arrivals:
            shard.expect(ri, trace[ti].arrival_time)
        for ti, ri, ids in arrivals:
            shard.submit(trace[ti], ti, ri, ids if isinstance(ids, list) else list(ids))
        if until is None:
            return None
        shard.run_until(until)
        return shard.states(until)

    def finish(self) -> tuple[MetricsCollector, list[ReplicaTotals], int]:
        self.shard.run_to_end()
        return self.shard.metrics, self.shard.totals(), self.shard.num_events


class _Local:
    """A shard in the head's process, behind the same calls as a worker."""

    def __init__(self, runner: ShardRunner) -> None:
        self.runner = runner
        self._reply: Any = None

    def send(self, msg: tuple) -> None:
        self._reply = (self.runner.advance(msg[1], msg[2]) if msg[0] == "advance"
                       else self.runner.finish())

    def recv(self) -> Any:
        return self._reply

    def close(self) -> None:
        pass


class _Remote:
    """A shard in a worker process, reached over a pipe."""

    def __init__(self, make_runner: Callable[[], ShardRunner], ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(make_runner, child), daemon=True)
        self.proc.start()
        child.close()

    def send(self, msg: tuple) -> None:
        self.conn.send(msg)

    def recv(self) -> Any:
        reply = self.conn.recv()
        if isinstance(reply, BaseException):
            raise RuntimeError(f"simulator worker failed: {reply!r}") from reply
        return reply

    def close(self) -> None:
        self.conn.close()
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


def _worker_main(make_runner: Callable[[], ShardRunner], conn: Any) -> None:
    from llmtower.sim.simulator import few_gc_passes
    try:
        with few_gc_passes():
            runner = make_runner()
            while True:
                msg = conn.recv()
                if msg[0] == "advance":
                    reply = runner.advance(msg[1], msg[2])
                    if reply is not None:
                        conn.send(reply)
                else:
                    conn.send(runner.finish())
                    return
    except BaseException as e:  # the head must hear of it rather than wait forever
        conn.send(e)
    finally:
        conn.close()


def route_sharded(trace: list[TraceRequest], balancer: Any, num_replicas: int,
                  make_shard: Callable[[list[int]], ReplicaShard], prompts: PromptFactory,
                  workers: int, routing_interval: float, progress: ProgressFn | None = None
                  ) -> tuple[MetricsCollector, list[ReplicaTotals], int]:
    """Run ``trace`` over ``num_replicas`` replicas split into ``workers`` shards (replica r
    in shard r mod workers); returns the merged metrics, every replica's totals (by index)
    and the number of events processed."""
    uses_state = getattr(balancer, "uses_state", True)
    if uses_state and routing_interval <= 0:
        raise ValueError(f"load_balancer {type(balancer).__name__} reads the replicas' state: "
                         "a run split over workers routes on state snapshots, so give "
                         "routing_interval > 0 (--routing-interval, e.g. 0.5 s as the real "
                         "head's stats interval) or use workers=1")
    workers = max(1, min(workers, num_replicas))
    owned = [[r for r in range(num_replicas) if r % workers == w] for w in range(workers)]
    if workers == 1:
        shards: list[Any] = [_Local(ShardRunner(make_shard(owned[0]), trace))]
    else:
        ctx = mp.get_context("fork")
        shards = [_Remote(_runner_factory(make_shard, owned[w], trace), ctx)
                  for w in range(workers)]
    try:
        if uses_state:
            _route_windows(trace, balancer, num_replicas, shards, prompts, routing_interval,
                           progress)
        else:
            _route_free(trace, balancer, num_replicas, shards, prompts, progress)
        for s in shards:
            s.send(("finish",))
        parts = [s.recv() for s in shards]
    finally:
        for s in shards:
            s.close()
    metrics = MetricsCollector.merge([p[0] for p in parts], num_replicas)
    totals = sorted((t for p in parts for t in p[1]), key=lambda t: t.index)
    return metrics, totals, sum(p[2] for p in parts)


def _runner_factory(make_shard: Callable[[list[int]], ReplicaShard], owned: list[int],
                    trace: list[TraceRequest]) -> Callable[[], ShardRunner]:
    return lambda: ShardRunner(make_shard(owned), trace)


def _route_free(trace: list[TraceRequest], balancer: Any, num_replicas: int, shards: list[Any],
                prompts: PromptFactory, progress: ProgressFn | None) -> None:
    """State-free routing: stream every shard its arrivals; nobody waits for anybody."""
    workers = len(shards)
    batches: list[list[Arrival]] = [[] for _ in shards]
    replicas = [_Idx(i) for i in range(num_replicas)]
    for i, tr in enumerate(trace):
        enc = prompts.encoded(tr)
        ri = balancer.choose(replicas, None)
        batches[ri % workers].append((i, ri, enc))
        if (i + 1) % CHUNK == 0:
            _flush(shards, batches, None)
            if progress is not None:
                progress(tr.arrival_time, i + 1)
    _flush(shards, batches, None)


def _route_windows(trace: list[TraceRequest], balancer: Any, num_replicas: int,
                   shards: list[Any], prompts: PromptFactory, interval: float,
                   progress: ProgressFn | None) -> None:
    """Stateful routing in lock-step windows of ``interval`` simulated seconds."""
    workers = len(shards)
    batches: list[list[Arrival]] = [[] for _ in shards]
    loads = [EngineLoad() for _ in range(num_replicas)]
    window = -math.inf
    for i, tr in enumerate(trace):
        k = math.floor(tr.arrival_time / interval)
        if k > window:  # a new window: every replica's state at its start
            window = k
            start = min(k * interval, tr.arrival_time)  # (k * interval may round above it)
            _flush(shards, batches, start, all_shards=True)
            for s in shards:
                for ri, st in s.recv().items():
                    ld = loads[ri]
                    ld.in_flight, ld.waiting, ld.running, ld.kv_usage = (
                        st.load, st.waiting, st.running, st.kv_usage)
            if progress is not None:
                progress(start, i)
        enc = prompts.encoded(tr)
        ri = balancer.choose_loads(loads, list(enc) if isinstance(enc, bytes) else enc)
        loads[ri].in_flight += 1  # the head counts what it sends at once
        batches[ri % workers].append((i, ri, enc))
    _flush(shards, batches, None)


def _flush(shards: list[Any], batches: list[list[Arrival]], until: float | None,
           all_shards: bool = False) -> None:
    for w, s in enumerate(shards):
        if batches[w] or all_shards:
            s.send(("advance", batches[w], until))
            batches[w] = []


class _Idx:
    """A stand-in replica for state-free balancers, which look at nothing but the index."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

