"""Two hosts on loopback: the head (API side, rank 0) and a headless host (rank 1) in its own
process tree, connected over TCP. Start order, the handshake timeout, outputs identical to one
engine, the sync across hosts, losing the headless host and its rejoining."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from llmtower.core.sampling_params import SamplingParams
from llmtower.distributed.dp_group import DPStatus
from llmtower.engine.args import EngineArgs
from llmtower.engine.async_llm import AsyncLLM
from llmtower.engine.core_client import EngineStartupError
from tests.distributed.dp_hosts import free_port_range, start_fake_headless, wait_until
from tests.engine.fake_engine_factory import make_slow_fake_engine

GUARD_S = 90  # against hangs only


def _head_args(port: int, **kw) -> EngineArgs:
    return EngineArgs(model="fake", data_parallel_size=2, data_parallel_size_local=1,
                      data_parallel_address="127.0.0.1", data_parallel_rpc_port=port,
                      dp_timeout=3.0, dp_sync_interval=4, **kw)


def _head(tokenizer, port: int, **kw) -> AsyncLLM:
    return AsyncLLM(_head_args(port, **kw), tokenizer=tokenizer,
                    engine_factory=make_slow_fake_engine, stats_interval_s=0.05)


async def _tokens(llm, rid, max_tokens=16):
    out = []
    async for ro in llm.generate("Hello world", llm.encode("Hello world"), SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.0), rid):
        out.extend(ro.outputs[0].token_ids)
    return out


def _stop(proc) -> None:
    if proc.is_alive():
        proc.terminate()
    proc.join(15)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)


def test_headless_host_serves_beside_the_head_and_rejoins_after_a_kill(tokenizer):
    port = free_port_range(8)
    host = start_fake_headless(data_parallel_size=2, data_parallel_start_rank=1,
                               data_parallel_size_local=1, data_parallel_address="127.0.0.1",
                               data_parallel_rpc_port=port, dp_timeout=3.0,
                               dp_sync_interval=4)  # started before the head: order is free
    restarted = None

    async def main():
        nonlocal restarted
        llm = _head(tokenizer, port)
        try:
            await asyncio.wait_for(llm.start(), GUARD_S)
            client = llm.client
            solo = await _tokens(llm, "solo")
            both = await asyncio.gather(*(_tokens(llm, f"r{i}") for i in range(6)))
            assert all(b == solo for b in both)  # the same outputs whichever host served
            per_rank = await client.call_utility_each("get_stats",
                                                      result_type=type(await llm.get_stats()))
            assert all(s.num_steps > 0 for s in per_rank)  # both hosts worked
            status = await client.call_utility_each("dp_status", result_type=DPStatus)
            for _ in range(200):  # each engine collects the wave's last sync on its own time
                if not any(s.in_wave for s in status):
                    break
                await asyncio.sleep(0.05)
                status = await client.call_utility_each("dp_status", result_type=DPStatus)
            assert [s.members for s in status] == [[0, 1], [0, 1]]
            assert status[0].num_syncs == status[1].num_syncs > 0

            # The headless host's engine is killed: the head notices within --dp-timeout,
            # serves on rank 0 and says it is degraded.
            os.kill(client.pids[1], signal.SIGKILL)
            await wait_until(lambda: 1 in client.lost, 15, "rank 1 counted lost")
            assert client.health()["status"] == "degraded"
            assert await _tokens(llm, "while-degraded") == solo
            host.join(15)  # the host exits once its engine failed
            assert host.exitcode == 1

            # Restarted, the host rejoins: a new epoch with both ranks, requests on both.
            restarted = start_fake_headless(
                data_parallel_size=2, data_parallel_start_rank=1, data_parallel_size_local=1,
                data_parallel_address="127.0.0.1", data_parallel_rpc_port=port, dp_timeout=3.0,
                dp_sync_interval=4)
            await wait_until(lambda: not client.lost, 60, "rank 1 back")
            await wait_until(lambda: client.health()["status"] == "ok", 5, "health ok")
            again = await asyncio.gather(*(_tokens(llm, f"again{i}") for i in range(4)))
            assert all(a == solo for a in again)
            await wait_until(lambda: client.epoch >= 2, 10, "the epoch of the rejoined rank")
            status = await client.call_utility_each("dp_status", result_type=DPStatus)
            return [s.members for s in status], [s.epoch for s in status]
        finally:
            llm.shutdown()

    try:
        members, epochs = asyncio.run(main())
        assert members == [[0, 1], [0, 1]] and epochs[0] == epochs[1] >= 2
        for p in (host, restarted):  # the head's shutdown stops the remote engines too
            if p is not None:
                p.join(15)
                assert p.exitcode == 0 or p is host
    finally:
        for p in (host, restarted):
            if p is not None:
                _stop(p)


def test_a_rank_that_never_arrives_is_named_in_the_startup_error(tokenizer):
    port = free_port_range(8)

    async def main():
        llm = _head(tokenizer, port, dp_startup_timeout=2.0)
        try:
            with pytest.raises(EngineStartupError, match=r"rank\(s\) \[1\].*rank 1 did not "
                               r"arrive within 2 s.*--headless"):
                await asyncio.wait_for(llm.client.start(), GUARD_S)
        finally:
            llm.shutdown()
    asyncio.run(main())
