"""The engines' process group on one host: the periodic all-reduce (counted, the same on every
engine), waves (idle engines stop together), and losing an engine without losing the server."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from llmtower.core.sampling_params import SamplingParams
from llmtower.distributed.dp_group import DPStatus
from llmtower.engine.args import EngineArgs
from llmtower.engine.async_llm import AsyncLLM
from llmtower.engine.core_client import EngineLostError
from tests.engine.fake_engine_factory import make_slow_fake_engine

GUARD_S = 120  # against hangs only


def _run(tokenizer, body, **engine_kw):
    async def main():
        llm = AsyncLLM(EngineArgs(model="fake", data_parallel_size=2, **engine_kw),
                       tokenizer=tokenizer, engine_factory=make_slow_fake_engine,
                       stats_interval_s=0.05)
        try:
            await asyncio.wait_for(llm.start(), GUARD_S)
            return await asyncio.wait_for(body(llm), GUARD_S)
        finally:
            llm.shutdown()
    return asyncio.run(main())


async def _tokens(llm, rid, max_tokens=20, out=None):
    ids = llm.encode("Hello world")
    out = [] if out is None else out
    async for ro in llm.generate("Hello world", ids, SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.0), rid):
        out.extend(ro.outputs[0].token_ids)
    return out


async def _status(llm) -> list[DPStatus]:
    return await llm.client.call_utility_each("dp_status", result_type=DPStatus)


async def _settled(llm, timeout_s: float = 20) -> list[DPStatus]:
    """The engines' status once the wave has ended everywhere (each engine collects the last
    collective on its own time, so right after the last output one may not have yet)."""
    t0 = time.monotonic()
    while True:
        status = await _status(llm)
        if not any(s.in_wave for s in status) or time.monotonic() - t0 > timeout_s:
            return status
        await asyncio.sleep(0.05)


def test_engines_sync_every_interval_and_stop_together_when_idle(tokenizer):
    async def body(llm):
        before = await _status(llm)
        # Only one request: engine 1 has nothing to do but must join the wave's syncs.
        await _tokens(llm, "one", max_tokens=40)
        after = await _settled(llm)  # the wave ends at the next sync once nobody has work
        procs = [psutil.Process(pid) for pid in llm.client.pids]
        cpu0 = [sum(p.cpu_times()[:2]) for p in procs]
        await asyncio.sleep(1.0)
        cpu = [sum(p.cpu_times()[:2]) - c for p, c in zip(procs, cpu0)]
        later = await _status(llm)
        ping = await llm.ping()
        return before, after, later, ping, llm.client.num_wave_starts, cpu

    before, after, later, ping, wave_starts, idle_cpu = _run(tokenizer, body, dp_sync_interval=4)
    assert [s.epoch for s in before] == [0, 0] and before[0].members == [0, 1]
    assert all(s.active for s in before)
    # 40 decode steps at one sync per 4 steps: about 10 collectives, the same on both engines
    # (a collective counts on every member or on none).
    assert after[0].num_syncs == after[1].num_syncs >= 40 // 4 - 1
    assert after[0].wave == after[1].wave == 1 and not any(s.in_wave for s in after)
    assert wave_starts >= 1
    # Idle: nobody syncs or steps any more, and the engines take (almost) no CPU time.
    assert [s.num_syncs for s in later] == [s.num_syncs for s in after]
    assert max(idle_cpu) < 0.1, idle_cpu
    assert ping.num_unfinished_requests == 0


def test_a_new_request_after_idleness_starts_a_new_wave_on_every_engine(tokenizer):
    async def body(llm):
        await _tokens(llm, "a", max_tokens=12)
        first = await _settled(llm)
        await asyncio.gather(_tokens(llm, "b", max_tokens=12), _tokens(llm, "c", max_tokens=12))
        return first, await _settled(llm)

    first, second = _run(tokenizer, body, dp_sync_interval=2)
    assert [s.wave for s in first] == [1, 1]
    assert [s.wave for s in second] == [2, 2]  # one more wave, ended together
    assert second[0].num_syncs == second[1].num_syncs > first[0].num_syncs


def test_losing_an_engine_keeps_the_server_serving(tokenizer):
    """kill -9 of the engine that holds a request that has started streaming: that request
    fails with a retriable error; the other engine's request finishes; new requests go to the
    survivor; the survivor forms a group of one (epoch 1); /health would say degraded."""
    async def body(llm):
        streamed: list[int] = []
        long = asyncio.ensure_future(_tokens(llm, "long", max_tokens=200, out=streamed))
        other = asyncio.ensure_future(_tokens(llm, "other", max_tokens=60))
        while llm.client.in_flight != [1, 1] or not streamed:
            await asyncio.sleep(0.01)
        victim = llm.client.engine_of("long")
        os.kill(llm.client.pids[victim], signal.SIGKILL)
        with pytest.raises(EngineLostError, match=f"rank {victim} was lost"):
            await long
        survived = await other
        t0 = time.monotonic()
        while llm.client.epoch < 1 and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.05)
        after = await _tokens(llm, "after", max_tokens=8)
        return (victim, survived, after, llm.client.health(), llm.is_dead,
                await _status(llm), llm.client.in_flight)

    victim, survived, after, health, dead, status, in_flight = _run(tokenizer, body)
    assert len(survived) == 60 and len(after) == 8
    assert not dead
    assert health["status"] == "degraded" and health["live_ranks"] == [1 - victim]
    assert str(victim) in health["lost_ranks"] and "SIGKILL" in health["lost_ranks"][str(victim)]
    assert status[0].epoch == 1 and status[0].members == [1 - victim]
    assert in_flight[1 - victim] == 0


def test_a_coordinated_reset_runs_on_every_engine_at_the_same_sync(tokenizer):
    """reset_prefix_cache while a wave runs: both engines hold it until the collective that
    shows both have it, and run it there (the same sync number on both)."""
    async def body(llm):
        long = asyncio.ensure_future(_tokens(llm, "long", max_tokens=120))
        await asyncio.sleep(0.3)  # the wave is on (engine 1 idle in it)
        in_wave = [s.in_wave for s in await _status(llm)]
        ok = await llm.client.call_utility("reset_prefix_cache", timeout_s=10)
        during = await _status(llm)
        await long
        return in_wave, ok, during

    in_wave, ok, during = _run(tokenizer, body, dp_sync_interval=4)
    assert in_wave == [True, True]
    assert isinstance(ok, bool)
    assert during[0].last_op_at_sync == during[1].last_op_at_sync >= 1
