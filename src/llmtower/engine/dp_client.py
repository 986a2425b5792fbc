"""Data parallelism: N engines (ranks) behind one API server, on this host or on several.

  head host: API process                            engine processes (one model copy, one KV
  ┌───────────────────────────────────────┐         cache, one scheduler each)
  │ AsyncLLM                              │ ─ipc──▶ rank 0 ┐
  │  └ DPEngineCoreClient (coordinator)   │ ─ipc──▶ rank 1 ├─ gloo process group: a sync
  │     ├ EngineCoreClient     (local)    │                │  (all-reduce) every
  │     ├ RemoteEngineClient   (TCP)      │ ─tcp──▶ rank 2 ┘  --dp-sync-interval steps
  │     ├ Router (load + prefix affinity) │         (host B: llmtower serve --headless)
  │     └ TCPStore of the process group   │
  └───────────────────────────────────────┘

Each request goes to the engine the ``Router`` picks (real load from the engines' stats, and
prefix affinity) and stays there: its aborts follow it, its outputs come back from it. The
output streams merge into one, each batch tagged with its ``engine_index`` (stats snapshots
too: the metrics keep one series per engine); ``merge_stats`` sums snapshots into one of the
whole server.

The coordinator's other jobs: relay a wave start from one engine to all others (see
``distributed/dp_group.py``), and keep membership. A lost engine (its process died, or a remote
one went silent) does not take the server down: its requests fail with a retriable 503, new
requests avoid it, ``/health`` says which ranks are gone, the survivors form a new process
group (a new epoch), and a remote rank that comes back is taken in again.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
from typing import Any

import msgspec

from llmtower.core.outputs import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from llmtower.distributed.dp_group import DPEvent, DPStatus
from llmtower.distributed.routing import EngineLoad, Router
from llmtower.engine.args import EngineArgs
from llmtower.engine.core_client import EngineCoreClient, EngineDeadError, EngineStartupError
from llmtower.engine.core_messages import EngineReady, PingResult, RequestError
from llmtower.engine.core_proc import HEARTBEAT_S, EngineFactory, default_engine_factory
from llmtower.engine.remote_client import RemoteEngineClient

logger = logging.getLogger(__name__)

# RequestError kind of a request whose engine was lost: HTTP 503, safe to retry.
ENGINE_LOST = "engine_lost"
# Utilities that change what every engine holds: run on all of them at one step boundary.
COORDINATED = frozenset({"reset_prefix_cache", "defragment"})


def engine_threads(args: EngineArgs) -> int:
    """Torch threads of each engine: --num-threads as given, else the cores shared out."""
    if args.num_threads:
        return args.num_threads
    from llmtower.executor.cpu_threads import available_cpus
    return max(1, available_cpus() // args.data_parallel_size)


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
    """Owns the N engine clients (local processes and remote ranks), which engine each request
    in flight lives on, each engine's latest stats and load, the router, the merged output
    queue, the process group's store and membership (epoch, lost ranks). Has the interface of
    ``EngineCoreClient``, so ``AsyncLLM`` does not know which it has."""

    def __init__(self, engine_args: EngineArgs,
                 engine_factory: EngineFactory = default_engine_factory,
                 stats_interval_s: float = 0.5, sigterm_grace_s: float | None = None) -> None:
        n = engine_args.data_parallel_size
        if n < 2:
            raise ValueError(f"data_parallel_size={n}: use EngineCoreClient for one engine")
        if engine_args.headless:
            raise ValueError("a --headless host runs no API server: use "
                             "llmtower.engine.headless.run_headless")
        self.engine_args = engine_args
        self.topology = engine_args.topology()
        self.engine_factory = engine_factory
        self.stats_interval_s = stats_interval_s
        self.sigterm_grace_s = sigterm_grace_s
        self.clients: list[EngineCoreClient] = [self._make_client(r) for r in range(n)]
        self.ready: EngineReady | None = None
        self.loads = [EngineLoad() for _ in range(n)]
        self.router = Router(engine_args.block_size)
        self._owner: dict[str, int] = {}
        self._stats: list[SchedulerStats] = [SchedulerStats() for _ in range(n)]
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._forwarders: dict[int, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self._dead_reason: str | None = None
        self._store: Any = None  # the process group's TCPStore, hosted here
        self.epoch = -1
        self.lost: dict[int, str] = {}  # rank -> why it is gone
        self.num_wave_starts = 0
        self._next_op = 0  # the last coordinated operation's number
        self._closing = False
        self._ray: Any = None  # RayEngines with --data-parallel-backend ray

    def _make_client(self, rank: int) -> EngineCoreClient:
        if rank not in self.topology.local_ranks:
            return RemoteEngineClient(self.engine_args, self.topology, rank)
        args = dataclasses.replace(self.engine_args, data_parallel_rank=rank,
                                   num_threads=engine_threads(self.engine_args))
        return EngineCoreClient(args, self.engine_factory, self.stats_interval_s,
                                self.sigterm_grace_s)

    # ------------------------------------------------------------------ state
    @property
    def in_flight(self) -> list[int]:
        return [load.in_flight for load in self.loads]

    @property
    def dead_reason(self) -> str | None:
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

    @property
    def live_ranks(self) -> list[int]:
        return [r for r in range(len(self.clients)) if r not in self.lost]

    def health(self) -> dict[str, Any]:
        """For /health: which ranks serve and which are gone (and why)."""
        return {"status": "degraded" if self.lost else "ok",
                "data_parallel_size": len(self.clients), "live_ranks": self.live_ranks,
                "lost_ranks": {str(r): why for r, why in sorted(self.lost.items())},
                "epoch": self.epoch}

    # ------------------------------------------------------------------ start
    async def start(self, timeout_s: float | None = None) -> EngineReady:
        """Host the process group's store, start every local engine and wait for every
        remote one; if one fails (or a remote rank does not arrive in time), stop them all
        and raise an error that names the rank."""
        self._start_store()
        if self.engine_args.data_parallel_backend == "ray":
            await self._start_ray(timeout_s)
        remote_timeout = timeout_s if timeout_s is not None else \
            self.engine_args.dp_startup_timeout
        results = await asyncio.gather(
            *(c.start(remote_timeout if isinstance(c, RemoteEngineClient) else timeout_s)
              for c in self.clients), return_exceptions=True)
        errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if errors:
            self.shutdown()
            missing = [i for i, _ in errors]
            i, err = errors[0]
            raise EngineStartupError(
                f"data-parallel rank(s) {missing} of {len(self.clients)} did not start; rank "
                f"{i}: {err}") from None
        readies: list[EngineReady] = results  # type: ignore[assignment]
        self.ready = msgspec.structs.replace(
            readies[0], num_gpu_blocks=sum(r.num_gpu_blocks for r in readies))
        self.router.block_size = readies[0].block_size
        loop = asyncio.get_running_loop()
        self._forwarders = {i: loop.create_task(self._forward(i))
                            for i in range(len(self.clients))}
        await self._set_membership()
        return self.ready

    async def _start_ray(self, timeout_s: float | None) -> None:
        """Every rank is a Ray actor that connects back like a --headless rank."""
        from llmtower.engine.ray_engines import RayEngines
        self._ray = RayEngines(self.engine_args, self.engine_factory, self.mark_rank_lost)
        try:
            await self._ray.start(timeout_s or self.engine_args.dp_startup_timeout)
        except Exception as e:
            self.shutdown()
            raise EngineStartupError(f"cannot start the engines on Ray: {e}") from None

    def _start_store(self) -> None:
        import torch.distributed as dist
        timeout = datetime.timedelta(seconds=self.engine_args.dp_timeout)
        if self.topology.multi_host:
            host, port = self.topology.address, self.topology.store_port
        else:  # one host: any free port on loopback, handed to the engines as they start
            host, port = "127.0.0.1", 0
        try:
            self._store = dist.TCPStore(host, port, None, True, timeout=timeout,
                                        wait_for_workers=False)
        except RuntimeError as e:
            raise EngineStartupError(
                f"cannot host the data-parallel store on {host}:{port}: {e}; pick another "
                "--data-parallel-rpc-port or check --data-parallel-address") from None
        for c in self.clients:
            if not isinstance(c, RemoteEngineClient):
                c.engine_args = dataclasses.replace(
                    c.engine_args, data_parallel_address=host,
                    data_parallel_rpc_port=self._store.port)

    def _responsive(self, rank: int) -> bool:
        """Heard from lately (engines send at least a heartbeat a second): a rank that went
        quiet is left out of a new group rather than letting every other rank wait for it."""
        return time.monotonic() - self.clients[rank].last_heard < 2.5 * HEARTBEAT_S

    async def _set_membership(self) -> None:
        """A new epoch: every live, responsive engine forms the process group of those
        ranks. A quiet rank left out is either lost soon (its silence passes --dp-timeout)
        or, if it speaks again, taken back in by a later epoch."""
        self.epoch += 1
        epoch = self.epoch
        members = [r for r in self.live_ranks if self._responsive(r)]
        quiet = [r for r in self.live_ranks if r not in members]
        if quiet:
            self._spawn(self._recheck(quiet, epoch))
        logger.info("data-parallel epoch %d: ranks %s%s", epoch, members,
                    f" (quiet, left out: {quiet})" if quiet else "")
        timeout = self.engine_args.dp_timeout * 2
        results = await asyncio.gather(*(
            self.clients[r].call_utility("dp_set_membership", epoch, members,
                                         result_type=DPStatus, timeout_s=timeout)
            for r in members), return_exceptions=True)
        for r, res in zip(members, results):
            if isinstance(res, BaseException) and epoch == self.epoch:
                logger.error("rank %d did not join epoch %d: %s", r, epoch, res)

    async def _recheck(self, quiet: list[int], epoch: int) -> None:
        await asyncio.sleep(self.engine_args.dp_timeout + HEARTBEAT_S)
        if self.epoch == epoch and not self._closing and \
                any(r not in self.lost and self._responsive(r) for r in quiet):
            await self._set_membership()

    # ------------------------------------------------------------------ send
    async def add_request(self, request: EngineCoreRequest) -> None:
        i = self._assign(request.request_id, request.prompt_token_ids)
        try:
            await self.clients[i].add_request(request)
        except BaseException:
            self._release(request.request_id)
            raise

    def _assign(self, request_id: str, token_ids: list[int] | None = None) -> int:
        """The engine the router picks (least loaded, prefix affinity; ties in turn)."""
        try:
            i = self.router.choose(self.loads, token_ids)
        except ValueError:
            raise EngineDeadError("no data-parallel engine is alive: "
                                  f"{self.health()['lost_ranks']}") from None
        self._owner[request_id] = i
        self.loads[i].in_flight += 1
        return i

    def engine_of(self, request_id: str) -> int | None:
        """The engine a request in flight was sent to (None once it is released)."""
        return self._owner.get(request_id)

    def _release(self, request_id: str) -> int | None:
        i = self._owner.pop(request_id, None)
        if i is not None:
            self.loads[i].in_flight -= 1
        return i

    def _by_engine(self, request_ids: list[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self._release(rid)
            if i is not None and i not in self.lost:  # finished or lost: nothing to abort
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
        """Run the utility on every live engine; merge what they return (pings and stats
        add up). The ``COORDINATED`` ones run on all engines at the same step boundary."""
        if method in COORDINATED:
            self._next_op += 1
            args = (self._next_op, method, list(args))
            method = "dp_coordinated"
        results = await self.call_utility_each(method, *args, result_type=result_type,
                                               timeout_s=timeout_s)
        if result_type is PingResult:
            return PingResult(sum(r.num_steps for r in results),
                              sum(r.num_unfinished_requests for r in results))
        if result_type is SchedulerStats:
            return merge_stats(results, results[0])
        if all(isinstance(r, bool) for r in results):  # e.g. reset_prefix_cache: done by all?
            return all(results)
        return results[0]

    async def call_utility_each(self, method: str, *args: Any, result_type: Any = Any,
                                timeout_s: float | None = None) -> list[Any]:
        """The utility's result from each live engine, in rank order."""
        live = self.live_ranks
        if not live:
            raise EngineDeadError(self.dead_reason or "no data-parallel engine is alive")
        return list(await asyncio.gather(*(
            self.clients[r].call_utility(method, *args, result_type=result_type,
                                         timeout_s=timeout_s) for r in live)))

    async def call_utility_on(self, engine_index: int, method: str, *args: Any,
                              result_type: Any = Any, timeout_s: float | None = None) -> Any:
        """One engine's answer alone (e.g. its KV cache snapshot)."""
        n = len(self.clients)
        if not 0 <= engine_index < n:
            raise ValueError(f"engine_id={engine_index} does not exist: this server runs "
                             f"{n} engine(s), 0..{n - 1}")
        return await self.clients[engine_index].call_utility(
            method, *args, result_type=result_type, timeout_s=timeout_s)

    async def data_parallel_view(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Health, the router's counters, wave starts and each live engine's ``DPStatus``."""
        statuses = await self.call_utility_each("dp_status", result_type=DPStatus,
                                                timeout_s=timeout_s)
        return {**self.health(), "routed": self.router.num_routed,
                "prefix_affinity_hits": self.router.num_affinity_hits,
                "wave_starts": self.num_wave_starts,
                "engines": [dataclasses.asdict(s) for s in statuses]}

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
                self._lose(i, str(e))
                return
            if isinstance(item, DPEvent):
                self._on_dp_event(i, item)
                continue
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
                    st = self._stats[i] = item.scheduler_stats
                    load = self.loads[i]
                    load.waiting, load.running = st.num_waiting_reqs, st.num_running_reqs
                    load.kv_usage = st.kv_cache_usage
            self._outputs.put_nowait(item)

    # ------------------------------------------------------------------ waves and membership
    def _on_dp_event(self, rank: int, event: DPEvent) -> None:
        if event.epoch != self.epoch:
            return  # about a group that no longer exists
        if event.kind == "wave_started":
            self.num_wave_starts += 1
            for r in self.live_ranks:
                if r != rank:
                    self._spawn(self._call_quietly(r, "dp_start_wave", event.wave))
        elif event.kind == "group_broken" and not self._closing:
            logger.warning("rank %d reports the process group of epoch %d broken: %s", rank,
                           event.epoch, event.detail.splitlines()[0] if event.detail else "")
            self._spawn(self._set_membership())

    async def _call_quietly(self, rank: int, method: str, *args: Any) -> None:
        try:
            await self.clients[rank].call_utility(method, *args,
                                                  timeout_s=self.engine_args.dp_timeout)
        except Exception as e:  # a lost engine is handled by its forwarder
            logger.debug("utility %s on rank %d failed: %s", method, rank, e)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def mark_rank_lost(self, rank: int, reason: str) -> None:
        """Rank ``rank`` is gone NOW (e.g. Ray reported its actor dead): no waiting for its
        silence to pass --dp-timeout. Before the start is complete nothing is routed yet:
        the start keeps waiting for the rank (a restarted engine is taken as it arrives)."""
        if self.ready is not None:
            self._lose(rank, reason)

    def _lose(self, rank: int, reason: str) -> None:
        """Rank ``rank`` is gone: fail its requests (retriable), route around it, form the
        group of the survivors, and wait for a remote rank to come back."""
        if self._closing or rank in self.lost:
            return
        self.lost[rank] = reason
        self.loads[rank].alive = False
        self.router.forget_engine(rank)
        failed = [rid for rid, e in self._owner.items() if e == rank]
        logger.error("data-parallel rank %d lost (%s); failing its %d request(s), serving on "
                     "ranks %s", rank, reason, len(failed), self.live_ranks)
        for rid in failed:
            self._release(rid)
            self._outputs.put_nowait(RequestError(
                rid, ENGINE_LOST, f"data-parallel rank {rank} was lost while serving this "
                f"request ({reason}); retry it: other ranks are serving"))
        self.loads[rank] = EngineLoad(alive=False)
        self._stats[rank] = SchedulerStats()
        if not self.live_ranks:
            self._mark_dead(f"every data-parallel rank is lost; last: rank {rank}: {reason}")
            return
        self._spawn(self._set_membership())
        if isinstance(self.clients[rank], RemoteEngineClient):
            self._spawn(self._rejoin(rank))

    async def _rejoin(self, rank: int) -> None:
        """Wait (for ever) for a restarted remote rank, then take it in again."""
        self.clients[rank].shutdown(timeout_s=0)
        client = RemoteEngineClient(self.engine_args, self.topology, rank)
        self.clients[rank] = client
        try:
            await client.start(timeout_s=None)
        except (EngineStartupError, asyncio.CancelledError):
            return
        if self._closing:
            return
        logger.info("data-parallel rank %d is back", rank)
        del self.lost[rank]
        self.loads[rank] = EngineLoad()
        self._forwarders[rank] = asyncio.get_running_loop().create_task(self._forward(rank))
        await self._set_membership()

    # ------------------------------------------------------------------ death and shutdown
    def mark_dead(self, reason: str) -> None:
        """EngineClient.mark_dead: the front end declares the engine unusable."""
        self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        self._outputs.put_nowait(EngineDeadError(reason))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._closing = True
        for task in [*self._forwarders.values(), *self._background]:
            task.cancel()
        if self._ray is not None:  # engines that exit now are not run again by Ray
            self._ray.unwatch()
        # Ask every engine first, then wait: they stop in parallel, not one after another.
        for c in self.clients:
            c.begin_shutdown()
        for c in self.clients:
            c.finish_shutdown(timeout_s)
        if self._ray is not None:
            self._ray.stop()
        self._store = None
        if self._dead_reason is None:
            self._dead_reason = "the engines were shut down"
