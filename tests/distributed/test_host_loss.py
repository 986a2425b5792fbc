"""Losing a headless host under load with the TCP backend (two hosts on loopback, the
headless one in its own process tree): requests sent 2 s after the kill all succeed, well
before --dp-timeout declares the host lost (new requests go only to engines heard from within
2.5 heartbeats, and un-started ones move off a silent engine); of the requests in flight at
the kill, only those that had started streaming fail, with the retryable 503."""
from __future__ import annotations

import asyncio
import signal
import time

import psutil

from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.async_llm import AsyncLLM
from llmtower.engine.core_client import EngineLostError
from tests.distributed.dp_hosts import free_port_range, start_fake_headless, wait_until
from tests.engine.fake_engine_factory import make_slow_fake_engine

GUARD_S = 90  # against hangs only
DP_TIMEOUT_S = 20.0  # long: what saves the requests below is liveness, not the loss
MAX_TOKENS = 30


def _args(port: int, **kw) -> dict:
    return dict(data_parallel_size=2, data_parallel_size_local=1,
                data_parallel_address="127.0.0.1", data_parallel_rpc_port=port,
                dp_timeout=DP_TIMEOUT_S, dp_sync_interval=4, max_num_seqs=2, **kw)


async def _run(llm, rid: str, streamed: dict[str, int]) -> list[int]:
    out: list[int] = []
    async for ro in llm.generate("Hello world", llm.encode("Hello world"), SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0), rid):
        out.extend(ro.outputs[0].token_ids)
        streamed[rid] = len(out)
    return out


def _kill_tree(pid: int) -> None:
    try:
        proc = psutil.Process(pid)
        for p in [*proc.children(recursive=True), proc]:
            p.send_signal(signal.SIGKILL)
    except psutil.NoSuchProcess:
        pass


def test_requests_sent_2s_after_a_host_is_killed_all_succeed(tokenizer):
    port = free_port_range(8)
    host = start_fake_headless(data_parallel_start_rank=1, **_args(port))

    async def main():
        llm = AsyncLLM(EngineArgs(model="fake", **_args(port)), tokenizer=tokenizer,
                       engine_factory=make_slow_fake_engine, stats_interval_s=0.05)
        try:
            await asyncio.wait_for(llm.start(), GUARD_S)
            client = llm.client
            solo = await _run(llm, "solo", {})
            # Load: 2 run on each engine, the rest wait there (max_num_seqs=2).
            streamed: dict[str, int] = {}
            before = {f"b{i}": asyncio.ensure_future(_run(llm, f"b{i}", streamed))
                      for i in range(12)}
            await wait_until(lambda: any(client.engine_of(r) == 1 and streamed.get(r)
                                         for r in before), 30, "rank 1 streaming")
            on_rank1 = {r for r in before if client.engine_of(r) == 1}
            started_at_kill = {r for r in on_rank1 if streamed.get(r)}
            _kill_tree(host.pid)
            killed = time.monotonic()
            await asyncio.sleep(2.0)
            after = await asyncio.wait_for(asyncio.gather(
                *(_run(llm, f"a{i}", {}) for i in range(8)), return_exceptions=True), GUARD_S)
            took = time.monotonic() - killed
            lost_yet = 1 in client.lost
            results = dict(zip(before, await asyncio.gather(*before.values(),
                                                            return_exceptions=True)))
            return (solo, after, took, lost_yet, on_rank1, started_at_kill, results,
                    client.num_retried)
        finally:
            llm.shutdown()

    try:
        solo, after, took, lost_yet, on_rank1, started, results, retried = asyncio.run(main())
    finally:
        _kill_tree(host.pid)
        host.join(10)
    # Every request sent 2 s after the kill succeeded, with the same greedy output, long
    # before the host's silence reached --dp-timeout.
    assert all(a == solo for a in after), (solo, [a for a in after if a != solo])
    assert took < DP_TIMEOUT_S - 5 and not lost_yet, (took, lost_yet)
    # Requests in flight at the kill: only rank 1's, and only ones that had streamed, failed
    # (retryable); rank 1's un-started ones were re-sent and completed.
    failed = {r for r, res in results.items() if isinstance(res, BaseException)}
    assert all(isinstance(results[r], EngineLostError) for r in failed), results
    assert failed <= on_rank1
    assert all(results[r] == solo for r in results if r not in failed)
    assert len(on_rank1 - started) >= 1 and retried >= len(on_rank1 - started)
    assert started <= failed or all(r in failed or results[r] == solo for r in started)
