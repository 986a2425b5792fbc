"""Draining one of two engines under load (``DPEngineCoreClient.drain``, behind
``llmtower ctl drain``): no request fails, the drained engine's un-started requests move to
the other, its running ones finish there, it gets nothing new until undrained."""
from __future__ import annotations

import asyncio

import pytest

from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.async_llm import AsyncLLM
from tests.distributed.dp_hosts import wait_until
from tests.engine.fake_engine_factory import make_slow_fake_engine

GUARD_S = 120  # against hangs only


async def _run(llm, rid: str, streamed: dict[str, int], max_tokens: int = 30) -> list[int]:
    out: list[int] = []
    async for ro in llm.generate("Hello world", llm.encode("Hello world"), SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.0), rid):
        out.extend(ro.outputs[0].token_ids)
        streamed[rid] = len(out)
    return out


def test_drain_under_load_loses_no_request_and_undrain_routes_again(tokenizer):
    async def body(llm):
        client = llm.client
        solo = await _run(llm, "solo", {})
        streamed: dict[str, int] = {}
        load = {f"r{i}": asyncio.ensure_future(_run(llm, f"r{i}", streamed)) for i in range(24)}
        await wait_until(lambda: any(client.engine_of(r) == 0 and streamed.get(r)
                                     for r in load), 30, "engine 0 streaming")
        running_on_0 = {r for r in load if client.engine_of(r) == 0 and streamed.get(r)}
        status = client.drain(0)
        with pytest.raises(ValueError, match="cannot drain engine 1: no other engine"):
            client.drain(1)
        more = {f"m{i}": asyncio.ensure_future(_run(llm, f"m{i}", streamed)) for i in range(6)}
        await wait_until(lambda: all(client.engine_of(r) is not None for r in more), 5, "sent")
        routed_while_draining = {client.engine_of(r) for r in more}
        results = dict(zip([*load, *more], await asyncio.wait_for(
            asyncio.gather(*load.values(), *more.values(), return_exceptions=True), GUARD_S)))
        await wait_until(lambda: client.drain_status(0)["drained"], 10, "engine 0 drained")
        drained = client.drain_status(0)
        view = await client.data_parallel_view(timeout_s=10)
        client.undrain(0)
        again = {f"u{i}": asyncio.ensure_future(_run(llm, f"u{i}", {}, 60)) for i in range(4)}
        await wait_until(lambda: all(client.engine_of(r) is not None for r in again), 5, "sent")
        routed_after = {client.engine_of(r) for r in again}
        await asyncio.gather(*again.values())
        return (solo, status, running_on_0, routed_while_draining, results, drained, view,
                routed_after, client.health())

    async def main():
        llm = AsyncLLM(EngineArgs(model="fake", data_parallel_size=2, max_num_seqs=2),
                       tokenizer=tokenizer, engine_factory=make_slow_fake_engine,
                       stats_interval_s=0.05)
        try:
            await asyncio.wait_for(llm.start(), GUARD_S)
            return await asyncio.wait_for(body(llm), GUARD_S)
        finally:
            llm.shutdown()

    (solo, status, running_on_0, routed_while_draining, results, drained, view, routed_after,
     health) = asyncio.run(main())
    # Not one request failed or changed: every one has the single-engine output.
    assert all(res == solo for res in results.values()), results
    # At the drain engine 0 ran some and held waiting ones: those moved, the running finished.
    assert status["draining"] and status["moved"] >= 1 and running_on_0
    assert routed_while_draining == {1}
    assert drained["drained"] and drained["in_flight"] == 0
    assert view["draining"]["0"]["drained"] and health["draining_ranks"] == []
    assert routed_after == {0, 1}  # undrained: routed to again
