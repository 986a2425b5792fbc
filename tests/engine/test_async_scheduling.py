"""--async-scheduling on the tiny Llama and Qwen2 models (real model runner, real sampler): the
same tokens as the serial engine under preemption, chunked prefill and prefix caching; stops
(EOS, stop ids, stop strings, max_tokens, the context length) that end exactly where they
should although they are seen one step late; seeded sampling; aborts while a step is in
flight; and the combinations refused at start."""
from __future__ import annotations

import pytest

from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs

pytest.importorskip("llmtower.engine.factory")


def make_llm(model_dir, async_scheduling: bool, **kw):
    from llmtower import LLM
    base = dict(num_threads=1, max_model_len=128, seed=0)
    return LLM(model=str(model_dir), async_scheduling=async_scheduling, **{**base, **kw})


def make_core(model_dir, async_scheduling: bool, **kw):
    from llmtower.engine.factory import create_engine_core
    base = dict(num_threads=1, max_model_len=128, seed=0)
    return create_engine_core(EngineArgs(model=str(model_dir), async_scheduling=async_scheduling,
                                         **{**base, **kw}))


def assert_kv_all_free(core) -> None:
    s = core.scheduler
    assert not s.requests and not s.kv.req_to_blocks
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


NUM_STEPS: dict[bool, int] = {}


def generate_both(model_dir, prompts, params, **kw):
    """(serial outputs, async outputs, async LLM's engine core) of one generate() each."""
    outs, core = [], None
    for mode in (False, True):
        llm = make_llm(model_dir, mode, **kw)
        try:
            outs.append(llm.generate(prompts, params, use_tqdm=False))
            core = llm.engine_core
            assert_kv_all_free(core)
            NUM_STEPS[mode] = core.executor.num_steps  # forward passes of the last generate_both
            assert (core.batch_queue is not None) == mode
        finally:
            llm.shutdown()
    return outs[0], outs[1], core


def run_core(core, reqs: list[EngineCoreRequest]) -> dict[str, tuple[list[int], str]]:
    """Engine-level run: each request's tokens and finish reason; nothing after a finish."""
    for r in reqs:
        core.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    finish: dict[str, str] = {}
    for _ in range(5000):
        if not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            assert o.request_id not in finish, "an output after the request's finish"
            tokens[o.request_id] += o.new_token_ids
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
    else:
        raise AssertionError("requests did not finish")
    return {rid: (tokens[rid], finish[rid]) for rid in tokens}


PROMPTS = [[5 + i, 17, 33, 40 + i] * (2 + i % 6) + [60 + i] for i in range(10)]
SHARED = [9, 8, 7, 6, 5, 4, 3, 12, 13, 14, 15, 16]  # three full blocks of 4: prefix hits


@pytest.mark.parametrize("arch,preemption_mode", [("llama", "recompute"), ("qwen2", "swap")])
def test_greedy_tokens_identical_under_preemption_chunking_and_prefix_caching(
        request, arch, preemption_mode):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    prompts = PROMPTS + [SHARED + [20 + i, 21] for i in range(4)]
    params = [SamplingParams(max_tokens=6 + 3 * (i % 7), temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    sync, asyn, core = generate_both(
        model_dir, prompts, params, block_size=4, num_gpu_blocks=36,
        max_num_batched_tokens=20, preemption_mode=preemption_mode, swap_space="4MiB")
    assert [o.outputs[0].token_ids for o in asyn] == [o.outputs[0].token_ids for o in sync]
    assert [o.outputs[0].finish_reason for o in asyn] == ["length"] * len(prompts)
    assert all(len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(asyn, params))
    stats = core.get_stats()
    assert stats.num_preemptions_total > 0  # the small KV cache did preempt
    assert stats.prefix_cache_hits > 0


def test_stop_ids_eos_and_max_tokens_end_exactly(tiny_llama_dir):
    """Each stop is a token the free run produces mid-way: the output ends right at it (stop
    ids, EOS) or at max_tokens, never with the extra token the next step already computed."""
    free = run_core(make_core(tiny_llama_dir, False), [
        EngineCoreRequest(f"f{i}", p, SamplingParams(max_tokens=24, temperature=0.0,
                                                     ignore_eos=True))
        for i, p in enumerate(PROMPTS)])
    reqs, expected = [], {}
    for i, p in enumerate(PROMPTS):
        toks = free[f"f{i}"][0]
        k = 2 + i % 9
        stop = toks[k]
        end = toks.index(stop) + 1  # the first occurrence stops it
        reqs.append(EngineCoreRequest(f"s{i}", p, SamplingParams(
            max_tokens=24, temperature=0.0, stop_token_ids=[stop])))
        expected[f"s{i}"] = (toks[:end], "stop")
        reqs.append(EngineCoreRequest(f"e{i}", p, SamplingParams(max_tokens=24, temperature=0.0),
                                      eos_token_id=stop))
        expected[f"e{i}"] = (toks[:end], "stop")
        reqs.append(EngineCoreRequest(f"m{i}", p, SamplingParams(
            max_tokens=k, temperature=0.0, ignore_eos=True)))
        expected[f"m{i}"] = (toks[:k], "length")
    for mode in (False, True):
        core = make_core(tiny_llama_dir, mode, block_size=4, num_gpu_blocks=48)
        assert run_core(core, reqs) == expected
        assert_kv_all_free(core)
        core.shutdown()


def test_stop_strings_n2_and_logprobs_identical(tiny_qwen2_dir):
    """Stop strings end requests in the client (an abort reaches the engine a step late),
    n > 1 samples, logprobs and prompt logprobs: as in the serial engine."""
    texts = ["Hello world, how are you", "The quick brown fox jumps over", "One two three"]
    free, _, _ = generate_both(tiny_qwen2_dir, texts, SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True))
    params = []
    for o in free:
        t = o.outputs[0].text
        params.append(SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                     stop=[t[len(t) // 2:len(t) // 2 + 2]], n=2, logprobs=2,
                                     prompt_logprobs=1))
    sync, asyn, _ = generate_both(tiny_qwen2_dir, texts, params)
    for s, a, f in zip(sync, asyn, free):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in s.outputs]
        assert [c.text for c in a.outputs] == [c.text for c in s.outputs]
        assert all(c.finish_reason == "stop" for c in a.outputs)
        assert len(a.outputs[0].token_ids) < len(f.outputs[0].token_ids)
        for cs, ca in zip(s.outputs, a.outputs):
            assert len(ca.logprobs) == len(ca.token_ids)
            assert [sorted(d) for d in ca.logprobs] == [sorted(d) for d in cs.logprobs]
        assert a.prompt_logprobs is not None and len(a.prompt_logprobs) == len(s.prompt_logprobs)


def test_seeded_sampling_reproducible_and_equal_to_serial(tiny_llama_dir):
    params = SamplingParams(n=2, temperature=0.9, top_p=0.95, seed=1234, max_tokens=16,
                            ignore_eos=True)
    prompts = ["Hello world", "The quick brown fox"]
    sync, asyn, _ = generate_both(tiny_llama_dir, prompts, params)
    _, again, _ = generate_both(tiny_llama_dir, prompts, params)
    toks = [[c.token_ids for c in o.outputs] for o in asyn]
    assert toks == [[c.token_ids for c in o.outputs] for o in sync]
    assert toks == [[c.token_ids for c in o.outputs] for o in again]
    assert toks[0][0] != toks[0][1]  # the two samples are not copies


@pytest.mark.parametrize("max_tokens", [None, 5])
def test_length_stops_cost_no_extra_forward_pass(tiny_llama_dir, max_tokens):
    """A request whose in-flight token is its last by length (max_tokens, or max_model_len)
    is never scheduled again: as many forward passes as the serial engine, not one more."""
    prompts = [[7, 8, 9, 10] * 10, [11, 12] * 23, [3] * 47]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    sync, asyn, _ = generate_both(tiny_llama_dir, prompts, params, max_model_len=48)
    assert [o.outputs[0].token_ids for o in asyn] == [o.outputs[0].token_ids for o in sync]
    lengths = [8, 2, 1] if max_tokens is None else [5, 2, 1]
    assert [len(o.outputs[0].token_ids) for o in asyn] == lengths
    assert all(o.outputs[0].finish_reason == "length" for o in asyn)
    assert NUM_STEPS[True] == NUM_STEPS[False] == max(lengths)


def test_abort_while_step_in_flight_frees_every_block(tiny_llama_dir):
    core = make_core(tiny_llama_dir, True, block_size=4, num_gpu_blocks=64)
    reqs = [EngineCoreRequest(f"r{i}", p, SamplingParams(max_tokens=30, temperature=0.0,
                                                         ignore_eos=True))
            for i, p in enumerate(PROMPTS[:6])]
    for r in reqs:
        core.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for _ in range(6):
        for o in core.step().outputs:
            got[o.request_id] += o.new_token_ids
    in_flight = core.batch_queue._in_flight[0][0].num_scheduled_tokens
    aborted = ["r0", "r2", "r4"]
    assert set(aborted) <= set(in_flight)
    assert core.abort_requests(aborted) == aborted
    kv = core.scheduler.kv
    held = sum(len(kv.req_to_blocks[r]) for r in ("r1", "r3", "r5"))
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - held
    cut = {r: len(got[r]) for r in aborted}
    finish = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            assert o.request_id not in aborted, "an output for an aborted request"
            got[o.request_id] += o.new_token_ids
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
    assert finish == {"r1": "length", "r3": "length", "r5": "length"}
    assert_kv_all_free(core)
    ref = run_core(make_core(tiny_llama_dir, False), reqs)
    for rid, (toks, _) in ref.items():
        if rid in aborted:
            assert got[rid] == toks[:cut[rid]]
        else:
            assert got[rid] == toks
    # The runner drops the aborted rows with the next step it runs.
    core.add_request(EngineCoreRequest("r0", [1, 2, 3], SamplingParams(max_tokens=2)))
    while core.has_unfinished_requests():
        core.step()
    rows = set(core.executor.runner.batch.req_id_to_row)
    assert not rows & {"r2", "r4"}
    core.shutdown()


def test_refused_combinations_name_the_flag(tiny_llama_dir):
    with pytest.raises(ValueError, match="--async-scheduling"):
        EngineArgs(async_scheduling=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    core = make_core(tiny_llama_dir, True)
    sp = SamplingParams(max_tokens=4, structured_outputs={"regex": "[ab]+"})
    with pytest.raises(ValueError, match="--async-scheduling"):
        core.add_request(EngineCoreRequest("x", [1, 2, 3], sp))
    assert not core.has_unfinished_requests()
    core.shutdown()
