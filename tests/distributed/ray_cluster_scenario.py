"""One run of the Ray backend on a real multi-node Ray cluster on this machine, for
test_ray_backend.py: run as ``python -m tests.distributed.ray_cluster_scenario TOKENIZER_DIR``
inside a network namespace with only ``lo`` up (Ray binds the host's address), it prints one
``RESULT {json}`` line with what it saw and tears everything down.

The cluster: a head node and two more, 1 CPU each; two engines spread over two of them. The
run: greedy outputs against one engine, both engines busy and in the metrics, then a node that
hosts an engine is removed under load (its streaming requests complete or fail with the
retryable ``engine_lost``; new requests sent a second after it succeed on the survivor), and
Ray restarts the engine on the node that is left, where it rejoins the group.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from typing import Any

import ray
from ray.cluster_utils import Cluster

from llmtower.core.sampling_params import SamplingParams
from llmtower.distributed.dp_group import DPStatus
from llmtower.engine.args import EngineArgs
from llmtower.engine.async_llm import AsyncLLM
from llmtower.engine.core_client import EngineLostError
from llmtower.models.tokenizer import load_tokenizer
from tests.distributed.dp_hosts import free_port_range, wait_until
from tests.engine.fake_engine_factory import make_slow_fake_engine

PROMPT = "Hello world"
LOAD_TOKENS = 100  # long enough to be streaming when the node goes; within max_model_len 128
NEW_AFTER_S = 1.0  # new requests this long after the node is removed all succeed
T0 = time.monotonic()


def _step(what: str) -> None:
    """Progress on stderr, so that a run cut short by its time limit shows where it was."""
    print(f"[scenario {time.monotonic() - T0:6.1f} s] {what}", file=sys.stderr, flush=True)


async def _tokens(llm: AsyncLLM, rid: str, max_tokens: int = 16,
                  first: asyncio.Event | None = None) -> list[int]:
    out: list[int] = []
    async for ro in llm.generate(PROMPT, llm.encode(PROMPT), SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.0), rid):
        out.extend(ro.outputs[0].token_ids)
        if first is not None and out:
            first.set()
    return out


async def _outcome(llm: AsyncLLM, rid: str, max_tokens: int,
                   first: asyncio.Event | None = None) -> dict[str, Any]:
    """How one request ended: done, or failed (after streaming or not); ``first`` is set
    once it has streamed a token."""
    n = 0
    try:
        async for ro in llm.generate(PROMPT, llm.encode(PROMPT), SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, temperature=0.0), rid):
            n += len(ro.outputs[0].token_ids)  # the outputs come as deltas
            if first is not None and n:
                first.set()
        return {"ok": True, "tokens": n}
    except EngineLostError:
        return {"ok": False, "lost": True, "streamed": n > 0}
    except Exception as e:
        return {"ok": False, "lost": False, "error": f"{type(e).__name__}: {e}"}


def _served_per_engine(metrics: bytes) -> dict[str, float]:
    served: dict[str, float] = {}
    for line in metrics.decode().splitlines():
        m = re.match(r'\S*request_success_total\{.*engine="(\d+)".*\} (\S+)', line)
        if m:
            served[m.group(1)] = served.get(m.group(1), 0.0) + float(m.group(2))
    return served


async def _solo(tokenizer: Any) -> list[int]:
    """The greedy output of one engine (the reference both Ray engines must give)."""
    one = AsyncLLM(EngineArgs(model="fake"), tokenizer=tokenizer,
                   engine_factory=make_slow_fake_engine, stats_interval_s=0.05)
    try:
        await one.start()
        return await _tokens(one, "solo")
    finally:
        one.shutdown()


async def scenario(cluster: Cluster, tokenizer: Any, nodes: dict[str, Any]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    port = free_port_range(8)
    args = EngineArgs(model="fake", data_parallel_size=2, data_parallel_backend="ray",
                      ray_placement="spread", data_parallel_address="127.0.0.1",
                      data_parallel_rpc_port=port, dp_timeout=5.0, dp_sync_interval=4)
    llm = AsyncLLM(args, tokenizer=tokenizer, engine_factory=make_slow_fake_engine,
                   stats_interval_s=0.05)
    try:
        t0 = time.monotonic()
        _step("starting the engines on Ray (and the one-engine reference meanwhile)")
        solo, _ = await asyncio.gather(_solo(tokenizer), asyncio.wait_for(llm.start(), 120))
        _step("engines up")
        res["start_s"] = time.monotonic() - t0
        client = llm.client
        ray_engines = client._ray
        both = await asyncio.gather(*(_tokens(llm, f"r{i}") for i in range(8)))
        res["same_as_one_engine"] = all(b == solo for b in both) and len(solo) == 16
        placed = ray_engines.placed
        res["nodes_of_ranks"] = [p["node_id"] if p else None for p in placed]
        res["served_per_engine"] = _served_per_engine(llm.metrics.render())
        status = await client.call_utility_each("dp_status", result_type=DPStatus)
        res["members"] = [s.members for s in status]

        # A node that hosts an engine (not the head node: that one holds the cluster) goes.
        victim = next(r for r, n in enumerate(res["nodes_of_ranks"])
                      if n != cluster.head_node.node_id)
        res["victim_rank"] = victim
        _step(f"outputs compared; ranks on {res['nodes_of_ranks']}; loading")
        started = [asyncio.Event() for _ in range(8)]
        load = [asyncio.ensure_future(_outcome(llm, f"load{i}", LOAD_TOKENS, started[i]))
                for i in range(8)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        t_kill = time.monotonic()
        _step(f"removing the node of rank {victim}")
        cluster.remove_node(nodes[res["nodes_of_ranks"][victim]], allow_graceful=False)
        # New requests NEW_AFTER_S after the kill, before Ray has necessarily said anything:
        # the closed connection keeps them off the lost engine (or moves them off it).
        await asyncio.sleep(max(0.0, t_kill + NEW_AFTER_S - time.monotonic()))
        res["new_sent_s"] = time.monotonic() - t_kill
        res["disconnect_seen"] = client.clients[victim].disconnected or victim in client.lost
        new = asyncio.ensure_future(asyncio.wait_for(asyncio.gather(
            *(_outcome(llm, f"new{i}", 8) for i in range(6))), 30))
        new.add_done_callback(lambda _: res.setdefault("new_done_s", time.monotonic() - t_kill))
        await wait_until(lambda: victim in client.lost, 30, "the lost rank reported")
        res["loss_seen_s"] = time.monotonic() - t_kill
        res["loss_reason"] = client.lost.get(victim, "")
        _step("loss seen")
        res["new_after_loss"] = await new
        res["load"] = await asyncio.wait_for(asyncio.gather(*load), 60)

        _step("new requests done; waiting for the engine to come back")
        await wait_until(lambda: not client.lost, 90, "the engine back")
        _step("engine back")
        res["back_s"] = time.monotonic() - t_kill
        placed = ray_engines.placed
        res["nodes_after"] = [p["node_id"] if p else None for p in placed]
        again = await asyncio.gather(*(_tokens(llm, f"again{i}") for i in range(6)))
        res["same_after_rejoin"] = all(a == solo for a in again)
        await wait_until(lambda: client.epoch >= 2, 15, "the epoch of the rejoined rank")
        status = await client.call_utility_each("dp_status", result_type=DPStatus)
        res["members_after"] = [s.members for s in status]
    finally:
        llm.shutdown()
    return res


def _start_head() -> Cluster:
    """The head node; started a second time if the first times out on a loaded machine
    (whatever the first left behind dies with the namespace)."""
    for attempt in range(2):
        try:
            return Cluster(initialize_head=True,
                           head_node_args={"num_cpus": 1, "include_dashboard": False})
        except Exception as e:
            if attempt:
                raise
            _step(f"the head node did not start ({e}); once more")
    raise AssertionError("unreachable")


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    tokenizer = load_tokenizer(sys.argv[1])
    t0 = time.monotonic()
    cluster = _start_head()
    res: dict[str, Any] = {}
    try:
        extra = [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        _step("cluster up")
        ray.init(address=cluster.address, log_to_driver=False)
        res["cluster_s"] = time.monotonic() - t0
        nodes = {n.node_id: n for n in [cluster.head_node, *extra]}
        res.update(asyncio.run(scenario(cluster, tokenizer, nodes)))
    except BaseException as e:
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        _step("tearing down")
        ray.shutdown()
        cluster.shutdown()
    res["total_s"] = time.monotonic() - t0
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
