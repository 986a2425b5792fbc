"""The data-parallel engines as Ray actors (``--data-parallel-backend ray``).

Each rank's engine runs the same engine process code as a ``--headless`` rank
(``EngineCoreProc.run_engine_core``), inside a Ray actor placed in that rank's bundle of the
placement group (``distributed/ray_backend.py``). It connects back to the head's sockets for its
rank over TCP, so on the head every rank is a ``RemoteEngineClient`` and the data path, the
gloo group and its sync are those of the TCP backend. What Ray adds:

- placement: the cluster picks the nodes (spread or packed), no host is started by hand;
- death reported at once: a task per rank awaits the actor's ``run``; when it fails, Ray says
  the actor died and the data-parallel client drops the rank at once (``mark_rank_lost``)
  instead of waiting for ``--dp-timeout`` seconds of heartbeat silence;
- replacement: Ray restarts the actor (on another node when its node is gone), the task runs
  the engine again, and the engine rejoins through the client's usual rejoin path.
"""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import time
from typing import Any
from collections.abc import Callable

from llmtower.distributed import ray_backend
from llmtower.engine.args import EngineArgs
from llmtower.engine.core_client import EngineStartupError
from llmtower.engine.core_proc import EngineCoreProc, EngineFactory

logger = logging.getLogger(__name__)

# After a loss, the wait before the rank's engine is started again; doubled while the
# engine keeps dying within QUICK_DEATH_S of its start (a crash loop), up to BACKOFF_MAX_S.
BACKOFF_S = 0.5
BACKOFF_MAX_S = 30.0
QUICK_DEATH_S = 10.0


def ray_engine_args(engine_args: EngineArgs, rank: int, threads: int) -> EngineArgs:
    """The settings of rank ``rank``'s engine: a one-rank headless host of the Ray backend."""
    return dataclasses.replace(engine_args, headless=True, data_parallel_rank=rank,
                               data_parallel_start_rank=rank, data_parallel_size_local=1,
                               num_threads=threads)


class RayEngines:
    """Owns the Ray side of a data-parallel server: the cluster connection, the placement
    group, one engine actor per rank and a task per rank that runs its engine and reports
    its death (``on_lost(rank, reason)``)."""

    def __init__(self, engine_args: EngineArgs, engine_factory: EngineFactory,
                 on_lost: Callable[[int, str], None]) -> None:
        self.engine_args = engine_args
        self.engine_factory = engine_factory
        self.on_lost = on_lost
        self.topology = engine_args.topology()
        cpus = float(engine_args.num_threads or 1)
        self.placement = ray_backend.RayPlacement(engine_args.data_parallel_size, cpus,
                                                  engine_args.ray_placement)
        self.threads = max(1, int(cpus))
        self.actors: list[Any] = []
        # Each rank's node (id, address) and pid as its actor reported them before starting
        # the engine; None while the rank is not running.
        self.placed: list[dict[str, str] | None] = [None] * engine_args.data_parallel_size
        self._pg: Any = None
        self._started_ray = False
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    async def start(self, timeout_s: float) -> None:
        """Join the cluster, reserve the bundles, start every rank's actor and engine."""
        self._started_ray = await asyncio.to_thread(ray_backend.connect)
        self._check_address()
        self._pg = await asyncio.to_thread(ray_backend.reserve, self.placement, timeout_s)
        loop = asyncio.get_running_loop()
        for rank in range(self.placement.num_engines):
            self.actors.append(ray_backend.start_actor(self._pg, rank,
                                                       self.placement.cpus_per_engine))
            self._tasks.append(loop.create_task(self._keep(rank)))
        logger.info("data-parallel engines: %d Ray actors (%s, %g CPU each) connecting to "
                    "%s:%d", self.placement.num_engines, self.placement.strategy,
                    self.placement.cpus_per_engine, self.topology.address,
                    self.topology.rpc_port)

    def _check_address(self) -> None:
        """Engines on other nodes cannot reach a loopback address: say what to give instead."""
        if not ipaddress.ip_address(self.topology.address).is_loopback:
            return
        ray = ray_backend.import_ray()
        others = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
                        - {"127.0.0.1", "::1"})
        if others:
            raise EngineStartupError(
                f"--data-parallel-address {self.topology.address} is a loopback address, "
                f"which the engines on the Ray nodes at {', '.join(others)} cannot reach: "
                f"give this host's address as the nodes see it, e.g. "
                f"--data-parallel-address {ray.util.get_node_ip_address()}")

    async def _keep(self, rank: int) -> None:
        """Run rank's engine in its actor; each time Ray reports it gone, report the loss and
        run it again (Ray queues the call until the actor has restarted; while it restarts,
        calls fail as unavailable and are simply repeated)."""
        args = ray_engine_args(self.engine_args, rank, self.threads)
        backoff = BACKOFF_S
        while not self._closing:
            started = time.monotonic()
            actor = self.actors[rank]
            restarting = False
            try:
                # Where it runs, asked first: once the engine runs, the actor is busy for good.
                self.placed[rank] = await actor.where.remote()
                await actor.run.remote(
                    EngineCoreProc.run_engine_core, self.engine_factory, args,
                    self.topology.input_address(rank), self.topology.output_address(rank))
                reason = "its engine returned"
            except asyncio.CancelledError:
                raise
            except Exception as e:
                restarting = ray_backend.is_unavailable(e)
                kind = "died" if ray_backend.is_actor_error(e) else "failed"
                first = str(e).splitlines()[0] if str(e) else ""
                reason = f"Ray reports the engine actor {kind}: {type(e).__name__}: {first}"
            self.placed[rank] = None
            if self._closing:
                return
            self.on_lost(rank, reason)  # a no-op while the rank is already lost
            if restarting or time.monotonic() - started >= QUICK_DEATH_S:
                backoff = BACKOFF_S
            else:  # died right after its start: a crash loop, slow it down
                backoff = min(backoff * 2, BACKOFF_MAX_S)
            await asyncio.sleep(backoff)

    def unwatch(self) -> None:
        """Stop watching and re-running the engines (the head is shutting them down)."""
        self._closing = True
        for task in self._tasks:
            task.cancel()

    def stop(self) -> None:
        """End the actors (without restart), release the bundles, leave a Ray started here."""
        self.unwatch()
        for actor in self.actors:
            ray_backend.stop_actor(actor)
        if self._pg is not None:
            ray_backend.release(self._pg)
            self._pg = None
        ray_backend.disconnect(self._started_ray)
