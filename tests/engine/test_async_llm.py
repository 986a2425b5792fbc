"""AsyncLLM over an engine process with the fake executor and the tiny tokenizer: streamed
deltas, n > 1, stop strings, validation, queue timeouts, disconnects and engine death."""
from __future__ import annotations

import asyncio
import threading
import os
import signal

import pytest

from fake_engine_factory import make_fake_engine, make_slow_fake_engine
from llmtower.core.errors import AdmissionError
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.async_llm import AsyncLLM, RequestTimeoutError
from llmtower.engine.core_client import EngineDeadError

GUARD_S = 120  # against hangs only: a loaded CI machine takes tens of seconds to spawn an engine


def _run(tokenizer, body, factory=make_fake_engine, request_timeout_s=None, **engine_kw):
    async def main():
        llm = AsyncLLM(EngineArgs(model="fake", **engine_kw), tokenizer=tokenizer,
                       engine_factory=factory, request_timeout_s=request_timeout_s,
                       stats_interval_s=0.05)
        try:
            await asyncio.wait_for(llm.start(), GUARD_S)
            return await asyncio.wait_for(body(llm), GUARD_S)
        finally:
            llm.shutdown()
    return asyncio.run(main())


async def _generate(llm: AsyncLLM, rid: str, prompt: str, **sp):
    """Join the deltas: per sample index, its text, its token ids and its finish reason."""
    ids = llm.encode(prompt)
    texts: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    last = None
    async for ro in llm.generate(prompt, ids, SamplingParams(**sp), rid):
        for c in ro.outputs:
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens.setdefault(c.index, []).extend(c.token_ids)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        last = ro
    assert last is not None and last.finished
    return texts, tokens, finish


def test_streamed_deltas_add_up_and_n_fans_in(tokenizer):
    async def body(llm):
        one = await _generate(llm, "a", "Hello world", max_tokens=12, ignore_eos=True,
                              temperature=0.0)
        two = await _generate(llm, "b", "Hello world", max_tokens=12, ignore_eos=True,
                              temperature=0.0, n=2)
        return one, two

    (texts, tokens, finish), (texts2, tokens2, finish2) = _run(tokenizer, body)
    assert len(tokens[0]) == 12 and finish == {0: "length"}
    assert texts[0] == tokenizer.decode(tokens[0], skip_special_tokens=True)
    # The fake model is deterministic: both samples equal the single one.
    assert tokens2 == {0: tokens[0], 1: tokens[0]} and finish2 == {0: "length", 1: "length"}


def test_stop_string_cuts_the_text_and_stops_the_engine(tokenizer):
    async def body(llm):
        (texts, _, _) = await _generate(llm, "full", "Hello world", max_tokens=40,
                                        ignore_eos=True, temperature=0.0)
        full = texts[0]
        stop = full[len(full) // 2:len(full) // 2 + 2]
        cut = await _generate(llm, "cut", "Hello world", max_tokens=40, ignore_eos=True,
                              temperature=0.0, stop=[stop])
        stats = await llm.get_stats()
        return full, stop, cut, stats

    full, stop, (texts, _, finish), stats = _run(tokenizer, body)
    assert texts[0] == full[:full.index(stop)] and finish == {0: "stop"}
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0


def test_prompt_longer_than_the_context_names_both_lengths(tokenizer):
    async def body(llm):
        ids = list(range(3, 3 + 150))
        with pytest.raises(AdmissionError, match=r"150 tokens.*128"):
            async for _ in llm.generate(None, ids, SamplingParams(max_tokens=1), "long"):
                pass
        # One length rule (as the offline LLM and vLLM): only the prompt is refused; a
        # max_tokens past the context is clamped to what is left and ends with "length".
        outs = [ro async for ro in llm.generate(
            None, ids[:50], SamplingParams(max_tokens=100, ignore_eos=True), "mt")]
        return outs

    outs = _run(tokenizer, body)
    assert sum(len(c.token_ids) for ro in outs for c in ro.outputs) == 128 - 50
    assert outs[-1].outputs[-1].finish_reason == "length"


def test_request_that_waits_past_the_timeout_gets_a_timeout_error(tokenizer):
    async def body(llm):
        blocker = llm.generate(None, [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True),
                               "blocker")
        await anext(blocker)  # it runs; max_num_seqs=1 keeps the next one queued
        with pytest.raises(RequestTimeoutError, match="request-timeout"):
            async for _ in llm.generate(None, [8, 9], SamplingParams(max_tokens=2), "late"):
                pass
        await blocker.aclose()
        return await llm.get_stats()

    # 100 steps of >= 10 ms each: the blocker runs for at least 1 s, past the 0.2 s timeout.
    stats = _run(tokenizer, body, make_slow_fake_engine, request_timeout_s=0.2, max_num_seqs=1)
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


def test_leaving_the_stream_aborts_the_request(tokenizer):
    async def body(llm):
        gen = llm.generate(None, [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True), "d")
        await anext(gen)
        await gen.aclose()  # what a disconnecting HTTP client does
        return await llm.get_stats()

    stats = _run(tokenizer, body, make_slow_fake_engine)
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0


def test_engine_death_fails_streams_with_engine_dead_error(tokenizer):
    async def body(llm):
        gen = llm.generate(None, [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True), "z")
        await anext(gen)
        os.kill(llm.client.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            async for _ in gen:
                pass
        assert llm.is_dead
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate(None, [1, 2], SamplingParams(), "after"):
                pass

    _run(tokenizer, body, make_slow_fake_engine)


def test_data_parallel_spreads_requests_and_merges_outputs(tokenizer):
    """Two engine processes: concurrent requests land on both, each output is what one engine
    alone gives, and stats, aborts and pings cover both engines."""
    async def body(llm):
        assert len(llm.client.clients) == 2 and len(set(llm.client.pids)) == 2
        solo = await _generate(llm, "solo", "Hello world", max_tokens=10, ignore_eos=True,
                               temperature=0.0)
        results = await asyncio.gather(*(
            _generate(llm, f"r{i}", "Hello world", max_tokens=10, ignore_eos=True,
                      temperature=0.0) for i in range(8)))
        # n = 2: the two samples are two engine requests, one on each engine
        pair = await _generate(llm, "pair", "Hello world", max_tokens=10, ignore_eos=True,
                               temperature=0.0, n=2)
        assert pair[1] == {0: solo[1][0], 1: solo[1][0]}
        # a stop string found in the client aborts the engine request where it lives
        stop = solo[0][0][len(solo[0][0]) // 2:][:2]
        cut = await _generate(llm, "cut", "Hello world", max_tokens=10, ignore_eos=True,
                              temperature=0.0, stop=[stop])
        assert cut[2] == {0: "stop"}
        # one more, aborted midway by leaving the stream
        stream = llm.generate("Hello world", llm.encode("Hello world"),
                              SamplingParams(max_tokens=100, ignore_eos=True), "left")
        async for _ in stream:
            break
        await stream.aclose()
        await asyncio.sleep(0.2)  # a stats snapshot after the abort
        per_engine = [await c.call_utility("get_stats", result_type=type(await llm.get_stats()))
                      for c in llm.client.clients]
        return solo, results, per_engine, await llm.get_stats(), await llm.ping(), llm.client.in_flight

    solo, results, per_engine, stats, ping, in_flight = _run(
        tokenizer, body, factory=make_slow_fake_engine, data_parallel_size=2)
    assert all(r[1] == solo[1] and r[2] == {0: "length"} for r in results)
    assert all(s.num_steps > 0 for s in per_engine)  # both engines worked
    assert stats.num_steps == sum(s.num_steps for s in per_engine)
    assert stats.num_total_blocks == sum(s.num_total_blocks for s in per_engine)
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0  # the abort freed its blocks
    assert ping.num_unfinished_requests == 0 and in_flight == [0, 0]


def test_data_parallel_engine_death_spares_the_other_engines_requests(tokenizer):
    """One engine of two dies: a request on the other one finishes, the server stays up and
    says which rank is gone; when the last engine dies too, the server is dead (503)."""
    async def body(llm):
        gen = llm.generate("Hello world", llm.encode("Hello world"),
                           SamplingParams(max_tokens=60, ignore_eos=True), "long")
        await gen.__anext__()
        assert llm.client.in_flight == [1, 0]  # the request lives on engine 0
        os.kill(llm.client.pids[1], signal.SIGKILL)
        n = 1
        async for _ro in gen:
            n += 1
        alive_after_one, health = not llm.is_dead, llm.client.health()
        os.kill(llm.client.pids[0], signal.SIGKILL)
        for _ in range(200):
            if llm.is_dead:
                break
            await asyncio.sleep(0.02)
        return n, alive_after_one, health, llm.is_dead, llm.dead_reason

    n, alive_after_one, health, dead, reason = _run(
        tokenizer, body, factory=make_slow_fake_engine, data_parallel_size=2)
    assert n >= 2 and alive_after_one
    assert health["lost_ranks"].keys() == {"1"} and "SIGKILL" in health["lost_ranks"]["1"]
    assert dead and "every data-parallel rank is lost" in reason


def test_offline_llm_refuses_data_parallel():
    from llmtower import LLM

    with pytest.raises(ValueError, match="llmtower serve --data-parallel-size"):
        LLM(model="anything", data_parallel_size=2)


def test_one_registry_holds_each_request_in_flight_and_nothing_after(tokenizer):
    async def body(llm):
        stream = llm.generate(None, [5, 6, 7], SamplingParams(n=2, max_tokens=50,
                                                              ignore_eos=True), "reg")
        await anext(stream)
        op = llm.output_processor
        parent = op.parents.get("reg")
        in_flight = (parent is not None and op.parent_of("reg-1") is parent
                     and parent.client_state.engine_ids == ["reg-0", "reg-1"]
                     and llm.num_requests_in_flight == 1)
        await stream.aclose()  # the client goes away: the request is forgotten everywhere
        return in_flight, dict(op.parents), dict(op.request_states), await llm.get_stats()

    # The slow engine (10 ms a step): with the plain fake one all 50 steps can be over before
    # the test looks, and the request is then rightly no longer in flight.
    in_flight, parents, states, stats = _run(tokenizer, body, make_slow_fake_engine)
    assert in_flight and parents == {} and states == {}
    assert stats.num_running_reqs == 0


def test_a_long_prompt_is_encoded_off_the_event_loop_and_a_short_one_on_it(tokenizer):
    """A large prompt must not stall the other clients while it is tokenized (issue 11); a
    short one is cheaper to encode in place than to send to a worker thread."""
    from llmtower.engine.async_llm import INLINE_ENCODE_CHARS

    async def body(llm):
        seen: list[str] = []
        encode = llm.input_processor.encode

        def spy(text, add_special_tokens=True):
            seen.append(threading.current_thread().name)
            return encode(text, add_special_tokens)

        llm.input_processor.encode = spy
        short = await llm.encode_async("hello " * 10)
        long_text = "hello " * (INLINE_ENCODE_CHARS // 6 + 50)
        long = await llm.encode_async(long_text)
        return seen, short, long, encode(long_text)

    seen, short, long, expected = _run(tokenizer, body)
    assert seen[0] == threading.main_thread().name
    assert seen[1] != threading.main_thread().name and seen[1].startswith("llmtower-prep")
    assert short == tokenizer.encode("hello " * 10) and long == expected
