"""Ray as the placer and watcher of the data-parallel engines (``--data-parallel-backend ray``).

This module knows Ray and nothing of engines: it joins the cluster (``RAY_ADDRESS``, or a
local one it starts), reserves one bundle of CPUs per engine in a placement group (spread
over the nodes or packed), and starts one ``EngineActor`` per rank in its bundle. What the
actor runs is handed in by the caller (``engine/ray_engines.py``: the engine process code of a
``--headless`` rank). Ray is optional: every entry point imports it through ``import_ray``,
whose error says how to install it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

INSTALL_HINT = "pip install 'llmtower[ray]'"
# Ray restarts a dead engine actor this many times (-1: without limit); each restart's
# engine rejoins the group. A dead node's bundle is placed again on a node with room.
MAX_RESTARTS = -1
STRATEGIES = {"spread": "SPREAD", "pack": "PACK"}


class RayUnavailableError(RuntimeError):
    """Ray is not installed, or the cluster cannot be joined or has no room."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayUnavailableError(
            "--data-parallel-backend ray needs Ray, which is not installed: "
            f"{INSTALL_HINT}, or drop the flag (the default backend, mp, needs nothing)") from None
    return ray


@dataclass(frozen=True)
class RayPlacement:
    """Owns what the engines ask of the cluster: how many, CPUs each, spread or packed."""

    num_engines: int
    cpus_per_engine: float = 1.0
    strategy: str = "spread"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"ray_placement={self.strategy!r} is invalid: use "
                             f"{' or '.join(STRATEGIES)}")
        if self.num_engines < 1 or not self.cpus_per_engine > 0:
            raise ValueError("a Ray placement needs 1 or more engines of more than 0 CPUs")

    @property
    def bundles(self) -> list[dict[str, float]]:
        return [{"CPU": self.cpus_per_engine} for _ in range(self.num_engines)]


def connect() -> bool:
    """Join the cluster at ``RAY_ADDRESS`` (or start a local one when it is unset); True
    when this call started Ray here, so that ``disconnect`` ends only what it started."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or None
    try:
        ray.init(address=address, log_to_driver=True)
    except ConnectionError as e:
        raise RayUnavailableError(f"cannot join the Ray cluster at RAY_ADDRESS={address}: {e}; "
                                  "start it (`ray start --head`) or fix RAY_ADDRESS") from None
    return True


def disconnect(started_here: bool) -> None:
    ray = import_ray()
    if started_here and ray.is_initialized():
        ray.shutdown()


def reserve(placement: RayPlacement, timeout_s: float) -> Any:
    """The placement group of one bundle per engine, once the cluster has placed it."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    pg = placement_group(placement.bundles, strategy=STRATEGIES[placement.strategy])
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RayUnavailableError(
            f"the Ray cluster found no room within {timeout_s:g} s for {placement.num_engines} "
            f"engine(s) of {placement.cpus_per_engine:g} CPU(s) each (cluster resources: "
            f"{ray.cluster_resources()}); add nodes, lower --data-parallel-size or "
            "--num-threads") from None
    return pg


def release(pg: Any) -> None:
    from ray.util.placement_group import remove_placement_group
    try:
        remove_placement_group(pg)
    except Exception:  # the cluster may be gone already; nothing is left to release then
        pass


class EngineActor:
    """Owns one engine's place on a Ray node: ``run`` executes the engine process code in
    this actor's own process, so that the actor's death (its node lost, the process killed)
    is the engine's death, which Ray reports to whoever awaits ``run``."""

    def run(self, target: Callable[..., Any], *args: Any) -> Any:
        return target(*args)  # the engine code ends the process itself when it stops

    def where(self) -> dict[str, str]:
        ray = import_ray()
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "pid": str(os.getpid())}


def start_actor(pg: Any, bundle: int, cpus: float) -> Any:
    """An ``EngineActor`` in bundle ``bundle`` of ``pg``, restarted by Ray when it dies."""
    ray = import_ray()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    cls = ray.remote(EngineActor)
    return cls.options(
        num_cpus=cpus, max_restarts=MAX_RESTARTS, max_task_retries=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=bundle)).remote()


def stop_actor(actor: Any) -> None:
    ray = import_ray()
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already dead, or the cluster is gone
        pass


def is_actor_error(e: BaseException) -> bool:
    """Ray's word that the actor (and so its engine) died or cannot be reached."""
    ray = import_ray()
    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


def is_unavailable(e: BaseException) -> bool:
    """The actor cannot be reached for now (its node is gone, Ray is restarting it)."""
    ray = import_ray()
    return isinstance(e, ray.exceptions.ActorUnavailableError)
