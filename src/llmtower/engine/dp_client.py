"""Data parallelism: N engines (ranks) behind one API server, on this host or on several.

(Over 500 lines on purpose: routing, loss and return, liveness and drain all read and change
one table, which engine owns each request; kept in one class so that its invariant -- a request
has one owner, and only the owner's outputs pass -- can be checked in one place.)

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
``distributed/dp_group.py``), and keep membership. A lost engine (its process died, a remote
one went silent for --dp-timeout, or ``mark_rank_lost`` was called: the one entry point, also
used by the Ray backend) does not take the server down: its requests that had started
streaming fail with a retriable 503, those that had not are re-sent to a live engine (the
client sees nothing), new requests avoid it, ``/health`` says which ranks are gone, the
survivors form a new process group (a new epoch), and a rank that comes back is taken in
again (``mark_rank_back``).

Liveness before loss: an engine not heard from within 2.5 heartbeats gets no new request,
and its un-started requests move to engines that speak; an output that arrives later from
the engine a request left is dropped (each request's owner decides), so nothing is doubled.

Drain (``drain`` / ``undrain``, ``llmtower ctl drain``): the engine gets no new request, its
un-started requests move to the others, its running ones finish where they are; once it holds
nothing it is drained (reported in the data-parallel view) and can be stopped or replaced.
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
# An engine silent for this long gets no new request (it sends a heartbeat a second).
QUIET_AFTER_S = 2.5 * HEARTBEAT_S


@dataclasses.dataclass
class DrainState:
    """One engine's drain: when it began, how many un-started requests it moved to other
    engines, and when the engine held no request any more (None: not yet)."""

    since: float  # wall-clock time (time.time())
    moved: int = 0
    drained_at: float | None = None


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
        # Requests sent whose engine has sent nothing back for them yet: on a loss, a quiet
        # engine or a drain they are re-sent elsewhere without the client noticing.
        self._unstarted: dict[str, EngineCoreRequest] = {}
        self.draining: dict[int, DrainState] = {}
        self.num_retried = 0  # un-started requests re-sent to another engine
        self._watcher: asyncio.Task | None = None
        self._next_op = 0  # the last coordinated operation's number
        self._closing = False
        self._ray: Any = None  # RayEngines with --data-parallel-backend ray

    def _make_client(self, rank: int) -> EngineCoreClient:
        if rank not in self.topology.local_ranks:
            return self._remote_client(rank)
        args = dataclasses.replace(self.engine_args, data_parallel_rank=rank,
                                   num_threads=engine_threads(self.engine_args))
        return EngineCoreClient(args, self.engine_factory, self.stats_interval_s,
                                self.sigterm_grace_s)

    def _remote_client(self, rank: int) -> RemoteEngineClient:
        client = RemoteEngineClient(self.engine_args, self.topology, rank)
        client.on_disconnect = self._on_disconnect
        return client

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
        """For /health: which ranks serve, which are drained or draining, which are gone."""
        return {"status": "degraded" if self.lost else "ok",
                "data_parallel_size": len(self.clients), "live_ranks": self.live_ranks,
                "lost_ranks": {str(r): why for r, why in sorted(self.lost.items())},
                "draining_ranks": sorted(self.draining), "epoch": self.epoch}

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
        self._watcher = loop.create_task(self._watch_quiet())
        await self._set_membership()
        return self.ready

    async def _start_ray(self, timeout_s: float | None) -> None:
        """Every rank is a Ray actor that connects back like a --headless rank."""
        from llmtower.engine.ray_engines import RayEngines
        self._ray = RayEngines(self.engine_args, self.engine_factory, self._lost_by_ray)
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
        """Heard from lately (engines send at least a heartbeat a second) and, a remote rank,
        still connected: a rank that went quiet or whose connection closed gets no new
        request and is left out of a new group rather than letting every other rank wait for
        it."""
        client = self.clients[rank]
        if isinstance(client, RemoteEngineClient) and client.disconnected:
            return False
        return time.monotonic() - client.last_heard < QUIET_AFTER_S

    def _on_disconnect(self, rank: int) -> None:
        """A remote rank's connection closed (its process or host died, most likely; Ray or
        --dp-timeout will say): no new request goes to it from now, and its un-started
        requests move to the others at once. If it reconnects it is routed to again."""
        if self._closing or rank in self.lost or self.ready is None:
            return
        moved = self._move_unstarted(rank)
        logger.warning("data-parallel rank %d: its connection closed; %d un-started request(s) "
                       "moved to ranks %s; no new request goes to it unless it reconnects",
                       rank, moved, [r for r in self.live_ranks if self._responsive(r)])

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
        # Sent by a task of its own: a send to an engine that just died can wait for ever
        # (its socket has no peer), and the caller must not wait with it: the request moves
        # on (a quiet engine's, a lost one's) and its outputs come from its new engine.
        i = self._assign(request.request_id, request.prompt_token_ids)
        self._unstarted[request.request_id] = request
        self._spawn(self._send_to(i, request))

    def _eligible(self, exclude: int | None = None) -> list[bool]:
        """Which engines may get a new request: live, not draining, heard from lately. When
        none is (every one quiet: say the head's own loop stalled), the quiet ones rather than
        a refusal; when only draining ones are left, those (serving beats failing)."""
        n = range(len(self.clients))
        live = [r not in self.lost and r != exclude for r in n]
        base = [ok and r not in self.draining for r, ok in zip(n, live)]
        fresh = [ok and self._responsive(r) for r, ok in zip(n, base)]
        return fresh if any(fresh) else base if any(base) else live

    def _assign(self, request_id: str, token_ids: list[int] | None = None,
                exclude: int | None = None) -> int:
        """The engine the router picks (least loaded, prefix affinity; ties in turn) among
        the eligible ones."""
        try:
            i = self.router.choose(self.loads, token_ids, self._eligible(exclude))
        except ValueError:
            raise EngineDeadError("no data-parallel engine is alive: "
                                  f"{self.health()['lost_ranks']}") from None
        self._owner[request_id] = i
        self.loads[i].in_flight += 1
        return i

    def _resend(self, request: EngineCoreRequest, exclude: int) -> bool:
        """Send an un-started request (already released) to another engine than
        ``exclude``; False when no engine is left."""
        try:
            j = self._assign(request.request_id, request.prompt_token_ids, exclude)
        except EngineDeadError:
            return False
        self._unstarted[request.request_id] = request
        self.num_retried += 1
        self._spawn(self._send_to(j, request))
        return True

    async def _send_to(self, rank: int, request: EngineCoreRequest) -> None:
        rid = request.request_id
        if self._owner.get(rid) != rank:
            return  # aborted (or moved again) before it could be sent
        try:
            await self.clients[rank].add_request(request)
        except EngineDeadError as e:  # that one is gone: its loss re-sends the request
            self.mark_rank_lost(rank, str(e))
        except Exception as e:  # never leave the caller waiting for an answer
            logger.exception("sending request %s to data-parallel rank %d failed", rid, rank)
            if self._owner.get(rid) == rank:
                self._release(rid)
                self._outputs.put_nowait(RequestError(rid, "invalid", f"cannot send the "
                                                      f"request to engine {rank}: {e}"))

    def _move_unstarted(self, rank: int) -> int:
        """Re-send every request of ``rank`` that has not started (nothing came back) to the
        other engines and abort it on ``rank``; how many moved."""
        if not any(r != rank for r in self.live_ranks):
            return 0
        ids = [rid for rid, e in self._owner.items() if e == rank and rid in self._unstarted]
        moved = []
        for rid in ids:
            request = self._unstarted[rid]
            self._release(rid)
            if self._resend(request, exclude=rank):
                moved.append(rid)
            else:  # cannot happen with another live engine; never leave a request hanging
                self._fail_lost(rid, rank, "no other engine could take it")
        if moved and rank not in self.lost:
            # Should the engine run one anyway, its outputs are dropped (see _forward).
            self.clients[rank].abort_requests_nowait(moved)
        return len(moved)

    def _fail_lost(self, request_id: str, rank: int, reason: str) -> None:
        self._outputs.put_nowait(RequestError(
            request_id, ENGINE_LOST, f"data-parallel rank {rank} was lost while serving this "
            f"request ({reason}); retry it: other ranks are serving"))

    def engine_of(self, request_id: str) -> int | None:
        """The engine a request in flight was sent to (None once it is released)."""
        return self._owner.get(request_id)

    def _release(self, request_id: str) -> int | None:
        self._unstarted.pop(request_id, None)
        i = self._owner.pop(request_id, None)
        if i is not None:
            self.loads[i].in_flight -= 1
            if self.draining and i in self.draining:
                self._check_drained(i)
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
        """Health, the router's counters, wave starts, drains and each live engine's
        ``DPStatus`` (an engine that does not answer in time, e.g. a dead host not yet
        declared lost, is listed in ``unanswered`` instead of failing the whole view)."""
        live = self.live_ranks
        if not live:
            raise EngineDeadError(self.dead_reason or "no data-parallel engine is alive")
        answers = await asyncio.gather(*(
            self.clients[r].call_utility("dp_status", result_type=DPStatus, timeout_s=timeout_s)
            for r in live), return_exceptions=True)
        statuses = [a for a in answers if isinstance(a, DPStatus)]
        return {**self.health(), "routed": self.router.num_routed,
                "prefix_affinity_hits": self.router.num_affinity_hits,
                "wave_starts": self.num_wave_starts, "retried": self.num_retried,
                "quiet_ranks": [r for r in self.live_ranks if not self._responsive(r)],
                "draining": {str(r): self.drain_status(r) for r in sorted(self.draining)},
                "unanswered": [r for r, a in zip(live, answers) if not isinstance(a, DPStatus)],
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
            owner = self._owner
            if isinstance(item, RequestError):
                if owner.get(item.request_id) != i:
                    continue  # the request left this engine (moved, aborted): not its answer
                self._release(item.request_id)
            else:
                item.engine_index = i
                if any(owner.get(out.request_id) != i for out in item.outputs):
                    # From an engine the request left (moved on, or aborted here): the
                    # request's new engine speaks for it, so nothing reaches the client twice.
                    item.outputs = [out for out in item.outputs if owner.get(out.request_id) == i]
                    item.request_errors = [e for e in item.request_errors
                                           if owner.get(e[0]) == i]
                    if not item.outputs and not item.request_errors and \
                            item.scheduler_stats is None:
                        continue  # nothing left for the client
                for out in item.outputs:
                    self._unstarted.pop(out.request_id, None)  # started: never re-sent
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
            self._spawn(self._reform_after_break(event.epoch))

    async def _reform_after_break(self, epoch: int) -> None:
        """A new group once a peer that broke it has had time to go quiet: a rank that died a
        moment ago still counts as heard from, and a group formed with it would hold every
        member's busy loop for --dp-timeout. The engines serve alone meanwhile."""
        await asyncio.sleep(QUIET_AFTER_S + HEARTBEAT_S)
        if self.epoch == epoch and not self._closing:  # not already re-formed (a loss, ...)
            await self._set_membership()

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

    def _lost_by_ray(self, rank: int, reason: str) -> None:
        """Ray reported rank ``rank``'s actor dead. Before the start is complete nothing is
        routed yet: the start keeps waiting for the rank (a restarted engine is taken as it
        arrives)."""
        if self.ready is not None:
            self.mark_rank_lost(rank, reason)

    def _lose(self, rank: int, reason: str) -> None:
        self.mark_rank_lost(rank, reason)

    def mark_rank_lost(self, rank: int, reason: str) -> None:
        """Rank ``rank`` is gone NOW (its process died, its host went silent, Ray reported its
        actor dead): route around it, re-send its un-started requests to live engines, fail
        those that had started streaming with the retriable 503, form the group of the
        survivors, and (a remote rank) wait for it to come back. Safe to call twice; call it
        on the server's event loop (from another thread: ``loop.call_soon_threadsafe``)."""
        if not 0 <= rank < len(self.clients):
            raise ValueError(f"rank {rank} does not exist: 0..{len(self.clients) - 1}")
        if self._closing or rank in self.lost:
            return
        self.lost[rank] = reason
        self.loads[rank].alive = False
        self.router.forget_engine(rank)
        forwarder = self._forwarders.get(rank)
        if forwarder is not None and forwarder is not asyncio.current_task():
            forwarder.cancel()  # its client is given up; a new one forwards if it comes back
        owned = [rid for rid, e in self._owner.items() if e == rank]
        failed = retried = 0
        for rid in owned:
            request = self._unstarted.get(rid)
            self._release(rid)
            if request is not None and self._resend(request, exclude=rank):
                retried += 1
            else:
                failed += 1
                self._fail_lost(rid, rank, reason)
        logger.error("data-parallel rank %d lost (%s); %d request(s) that had started failed, "
                     "%d re-sent; serving on ranks %s", rank, reason, failed, retried,
                     self.live_ranks)
        self.loads[rank] = EngineLoad(alive=False)
        self._stats[rank] = SchedulerStats()
        if not self.live_ranks:
            self._mark_dead(f"every data-parallel rank is lost; last: rank {rank}: {reason}")
            return
        self._spawn(self._set_membership())
        if isinstance(self.clients[rank], RemoteEngineClient):
            self._spawn(self._rejoin(rank))

    def mark_rank_back(self, rank: int) -> bool:
        """Rank ``rank`` serves again: its client (``self.clients[rank]``) has done its
        handshake (a restarted headless host, a restarted Ray actor). It gets requests again
        (unless drained), its outputs are forwarded, and a new epoch takes it in. False (and
        nothing done) when it was not lost or its client is not started yet."""
        if self._closing or rank not in self.lost or self.clients[rank].ready is None:
            return False
        logger.info("data-parallel rank %d is back", rank)
        del self.lost[rank]
        self.loads[rank] = EngineLoad()
        self._stats[rank] = SchedulerStats()
        old = self._forwarders.get(rank)
        if old is not None and not old.done():
            old.cancel()
        self._forwarders[rank] = asyncio.get_running_loop().create_task(self._forward(rank))
        self._spawn(self._set_membership())
        return True

    async def _rejoin(self, rank: int) -> None:
        """Wait (for ever) for a restarted remote rank, then take it in again."""
        self.clients[rank].shutdown(timeout_s=0)
        client = self._remote_client(rank)
        self.clients[rank] = client
        try:
            await client.start(timeout_s=None)
        except (EngineStartupError, asyncio.CancelledError):
            return
        if not self._closing:
            self.mark_rank_back(rank)

    async def _watch_quiet(self) -> None:
        """An engine silent for 2.5 heartbeats gets no new request (``_eligible``); here its
        un-started requests move to engines that speak, at once rather than after
        --dp-timeout (when its loss is declared)."""
        while not self._closing:
            await asyncio.sleep(HEARTBEAT_S / 2)
            live = self.live_ranks
            speaking = [r for r in live if self._responsive(r)]
            for r in live:
                if speaking and r not in speaking and any(e == r for e in self._owner.values()):
                    moved = self._move_unstarted(r)
                    if moved:
                        logger.warning("data-parallel rank %d silent for %.1f s: %d un-started "
                                       "request(s) moved to ranks %s", r, time.monotonic() -
                                       self.clients[r].last_heard, moved, speaking)

    # ------------------------------------------------------------------ drain
    def drain(self, rank: int) -> dict[str, Any]:
        """Stop routing to ``rank``, move its un-started requests to the others, let its
        running ones finish; it is drained once it holds nothing (``drain_status``). It
        stays out of routing (across a restart too) until ``undrain``. ValueError when no
        other engine would serve."""
        self._check_rank(rank)
        if rank not in self.draining:
            others = [r for r in self.live_ranks if r != rank and r not in self.draining]
            if not others:
                raise ValueError(f"cannot drain engine {rank}: no other engine would serve "
                                 f"(live: {self.live_ranks}, draining: {sorted(self.draining)})"
                                 "; undrain one first or add an engine")
            state = self.draining[rank] = DrainState(since=time.time())
            state.moved = self._move_unstarted(rank)
            logger.info("data-parallel rank %d draining: %d un-started request(s) moved to "
                        "ranks %s, %d running left to finish", rank, state.moved, others,
                        self.loads[rank].in_flight)
            self._check_drained(rank)
        return self.drain_status(rank)

    def undrain(self, rank: int) -> dict[str, Any]:
        """Route to ``rank`` again (it must be live to get requests)."""
        self._check_rank(rank)
        if self.draining.pop(rank, None) is not None:
            logger.info("data-parallel rank %d undrained: routed to again", rank)
        return self.drain_status(rank)

    def set_draining(self, engine_index: int, draining: bool) -> dict[str, Any] | None:
        """EngineClient.set_draining: ``drain`` or ``undrain``."""
        return self.drain(engine_index) if draining else self.undrain(engine_index)

    def drain_status(self, rank: int) -> dict[str, Any]:
        """Whether ``rank`` is draining / drained, what it still holds, what moved off it."""
        self._check_rank(rank)
        state = self.draining.get(rank)
        return {"engine_index": rank, "draining": state is not None,
                "drained": state is not None and state.drained_at is not None,
                "in_flight": self.loads[rank].in_flight, "lost": rank in self.lost,
                "moved": state.moved if state else 0, "since": state.since if state else None,
                "drained_at": state.drained_at if state else None}

    def _check_drained(self, rank: int) -> None:
        state = self.draining.get(rank)
        if state is not None and state.drained_at is None and self.loads[rank].in_flight == 0:
            state.drained_at = time.time()
            logger.info("data-parallel rank %d drained: it holds no request (%.1f s); it can "
                        "be stopped or replaced (`llmtower ctl undrain --engine-id %d` routes "
                        "to it again)", rank, state.drained_at - state.since, rank)

    def _check_rank(self, rank: int) -> None:
        n = len(self.clients)
        if not 0 <= rank < n:
            raise ValueError(f"engine_id={rank} does not exist: this server runs {n} "
                             f"engine(s), 0..{n - 1}")

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
        if self._watcher is not None:
            self._watcher.cancel()
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
