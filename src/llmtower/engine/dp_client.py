"""Data parallelism: N engine processes behind one API server.

  API process                                   engine processes (one model copy, one KV cache,
  ┌──────────────────────────────────┐          one scheduler each)
  │ AsyncLLM                         │ ──add──▶ EngineCore 0   (requests r1, r4, ...)
  │  └ DPEngineCoreClient            │ ──add──▶ EngineCore 1   (requests r2, r3, ...)
  │     ├ EngineCoreClient 0 ◀─outs──┤ ...
  │     └ EngineCoreClient 1 ◀─outs──┤
  └──────────────────────────────────┘

Each request goes to the engine with the fewest requests in flight (ties: the next one in
turn) and stays there: its aborts follow it, its outputs come back from it. The engines'
output streams are merged into one, each batch tagged with its ``engine_index`` (stats
snapshots too: the metrics keep one series per engine); ``merge_stats`` sums snapshots into
one of the whole server (queues, blocks and counters; KV usage over all blocks). One engine
dying makes the server dead, as with one engine: clients get 503 and the operator restarts it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

import msgspec

from llmtower.core.outputs import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from llmtower.engine.args import EngineArgs
from llmtower.engine.core_client import EngineCoreClient, EngineDeadError, EngineStartupError
from llmtower.engine.core_messages import EngineReady, PingResult, RequestError
from llmtower.engine.core_proc import EngineFactory, default_engine_factory


def engine_threads(args: EngineArgs) -> int:
    """Torch threads of each engine: --num-threads as given, else the cores shared out."""
    if args.num_threads:
        return args.num_threads
    return max(1, (os.cpu_count() or 1) // args.data_parallel_size)


def merge_stats(snapshots: list[SchedulerStats], latest: SchedulerStats) -> SchedulerStats:
    """One snapshot of all engines: sums of queues, blocks and counters from each engine's
    latest snapshot; the per-step figures (histograms, batch utilization) only from
    ``latest``, the one that just arrived, so that no step is counted twice."""
    total = sum(s.num_total_blocks for s in snapshots)
    free = sum(s.num_free_blocks for s in snapshots)
    summed = {f: sum(getattr(s, f) for s in snapshots) for f in (
        "num_running_reqs", "num_waiting_reqs", "num_swapped_reqs", "num_free_blocks",
        "num_total_blocks", "num_free_cpu_blocks", "prefix_cache_queries", "prefix_cache_hits",
        "num_evictions", "num_preemptions_total", "num_swap_outs_total", "num_swap_ins_total",
        "num_rejected_total", "num_steps", "input_queue_size", "num_cached_blocks")}
    return msgspec.structs.replace(
        latest, **summed,
        kv_cache_usage=(total - free) / total if total else 0.0,
        fragmentation=sum(s.fragmentation for s in snapshots) / len(snapshots),
        external_fragmentation=sum(s.external_fragmentation for s in snapshots) / len(snapshots))


class DPEngineCoreClient:
    """Owns N ``EngineCoreClient``s, which engine each request in flight lives on, how many
    each engine holds, each engine's latest stats snapshot and the merged output queue. Has
    the interface of ``EngineCoreClient``, so ``AsyncLLM`` does not know which it has."""

    def __init__(self, engine_args: EngineArgs,
                 engine_factory: EngineFactory = default_engine_factory,
                 stats_interval_s: float = 0.5) -> None:
        n = engine_args.data_parallel_size
        if n < 2:
            raise ValueError(f"data_parallel_size={n}: use EngineCoreClient for one engine")
        one = dataclasses.replace(engine_args, data_parallel_size=1,
                                  num_threads=engine_threads(engine_args))
        self.engine_args = engine_args
        self.clients = [EngineCoreClient(one, engine_factory, stats_interval_s) for _ in range(n)]
        self.ready: EngineReady | None = None
        self.in_flight = [0] * n
        self._owner: dict[str, int] = {}
        self._next = 0  # tie-break: the next engine in turn
        self._stats: list[SchedulerStats] = [SchedulerStats() for _ in range(n)]
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._forwarders: list[asyncio.Task] = []
        self._dead_reason: str | None = None

    # ------------------------------------------------------------------ state
    @property
    def dead_reason(self) -> str | None:
        if self._dead_reason is None:
            dead = next((c for c in self.clients if c.is_dead), None)
            if dead is not None:
                return dead.dead_reason
        return self._dead_reason

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def pid(self) -> int | None:
        return self.clients[0].pid

    @property
    def pids(self) -> list[int | None]:
        return [c.pid for c in self.clients]

    # ------------------------------------------------------------------ start
    async def start(self, timeout_s: float | None = None) -> EngineReady:
        """Start every engine at once; if one fails, stop them all and raise its error."""
        results = await asyncio.gather(*(c.start(timeout_s) for c in self.clients),
                                       return_exceptions=True)
        errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if errors:
            self.shutdown()
            i, err = errors[0]
            raise EngineStartupError(f"engine {i} of {len(self.clients)}: {err}") from None
        readies: list[EngineReady] = results  # type: ignore[assignment]
        self.ready = msgspec.structs.replace(
            readies[0], num_gpu_blocks=sum(r.num_gpu_blocks for r in readies))
        loop = asyncio.get_running_loop()
        self._forwarders = [loop.create_task(self._forward(i)) for i in range(len(self.clients))]
        return self.ready

    # ------------------------------------------------------------------ send
    async def add_request(self, request: EngineCoreRequest) -> None:
        i = self._assign(request.request_id)
        try:
            await self.clients[i].add_request(request)
        except BaseException:
            self._release(request.request_id)
            raise

    def _assign(self, request_id: str) -> int:
        """The engine with the fewest requests in flight, the next in turn among equals."""
        n = len(self.clients)
        order = [(self._next + k) % n for k in range(n)]
        i = min(order, key=lambda e: self.in_flight[e])
        self._next = (i + 1) % n
        self._owner[request_id] = i
        self.in_flight[i] += 1
        return i

    def engine_of(self, request_id: str) -> int | None:
        """The engine a request in flight was sent to (None once it is released)."""
        return self._owner.get(request_id)

    def _release(self, request_id: str) -> int | None:
        i = self._owner.pop(request_id, None)
        if i is not None:
            self.in_flight[i] -= 1
        return i

    def _by_engine(self, request_ids: list[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self._release(rid)
            if i is not None:  # finished already: nothing to abort
                groups.setdefault(i, []).append(rid)
        return groups

    async def abort_requests(self, request_ids: list[str]) -> None:
        for i, ids in self._by_engine(request_ids).items():
            await self.clients[i].abort_requests(ids)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        for i, ids in self._by_engine(request_ids).items():
            self.clients[i].abort_requests_nowait(ids)

    async def call_utility(self, method: str, *args: Any, result_type: Any = Any,
                           timeout_s: float | None = None) -> Any:
        """Run the utility on every engine; merge what they return (pings and stats add up)."""
        results = await asyncio.gather(*(
            c.call_utility(method, *args, result_type=result_type, timeout_s=timeout_s)
            for c in self.clients))
        if result_type is PingResult:
            return PingResult(sum(r.num_steps for r in results),
                              sum(r.num_unfinished_requests for r in results))
        if result_type is SchedulerStats:
            return merge_stats(results, results[0])
        return results[0]

    # ------------------------------------------------------------------ receive
    async def get_output(self) -> EngineCoreOutputs | RequestError:
        item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put_nowait(item)
            raise item
        return item

    async def _forward(self, i: int) -> None:
        client = self.clients[i]
        while True:
            try:
                item = await client.get_output()
            except EngineDeadError as e:
                self._mark_dead(f"engine {i} of {len(self.clients)}: {e}")
                return
            if isinstance(item, RequestError):
                self._release(item.request_id)
            else:
                item.engine_index = i
                for out in item.outputs:
                    if out.finish_reason is not None:
                        self._release(out.request_id)
                if item.scheduler_stats is not None:
                    # Passed on as the engine's own snapshot (tagged by engine_index): the
                    # metrics keep one series per engine; merge_stats() sums them.
                    self._stats[i] = item.scheduler_stats
            self._outputs.put_nowait(item)

    # ------------------------------------------------------------------ death and shutdown
    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        self._outputs.put_nowait(EngineDeadError(reason))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        for task in self._forwarders:
            task.cancel()
        for c in self.clients:
            c.shutdown(timeout_s)
        if self._dead_reason is None:
            self._dead_reason = "the engines were shut down"
