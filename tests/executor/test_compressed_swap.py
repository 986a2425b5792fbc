"""Compressed swap on the real engine (tiny Llamas): ``--swap-space-dtype int8`` keeps greedy
outputs close to an uncompressed swap, the slotted swap space without compression is token-
and logprob-exact, and aborting a request whose blocks sit compressed in the swap space leaks
neither a KV block nor a swap slot."""
from __future__ import annotations

from exactness_helpers import make_engine, random_prompts
from llmtower.core.swap_layout import PLAIN
from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams

MAX_TOKENS = 16
PROMPTS = random_prompts(8, 5, 40, seed=11)
# A pool far too small for the batch: many swap preemptions.
PRESSURE = dict(num_gpu_blocks=40, preemption_mode="swap", max_num_batched_tokens=16,
                long_prefill_token_threshold=8, max_num_partial_prefills=2)


def add(core, prompts=PROMPTS) -> None:
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), p, SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0), eos_token_id=2))


def finish(core, out=None) -> dict[str, list[tuple[int, float]]]:
    out = {} if out is None else out
    for _ in range(5000):
        if not core.has_unfinished_requests():
            return out
        for o in core.step().outputs:
            out.setdefault(o.request_id, []).extend((e[0], e[1]) for e in o.new_logprobs)
    raise AssertionError("the engine did not finish its requests")


def run(model_dir, **kw):
    core = make_engine(model_dir, **{**PRESSURE, **kw})
    add(core)
    return finish(core), core


def agreement(ref, got) -> tuple[float, float]:
    same = total = 0
    err = 0.0
    for rid, want in ref.items():
        total += len(want)
        for (t0, lp0), (t1, lp1) in zip(want, got[rid]):
            if t0 != t1:
                break
            same += 1
            err = max(err, abs(lp0 - lp1))
    return same / total, err


def test_int8_swap_space_stays_close_to_an_uncompressed_swap(tiny_llama_dir):
    ref, core = run(tiny_llama_dir)
    assert core.scheduler.num_swap_outs > 0 and core.scheduler.kv.swap_layout == PLAIN
    got, ccore = run(tiny_llama_dir, swap_space_dtype="int8")
    sched = ccore.scheduler
    assert sched.num_swap_outs > 0
    assert sched.degradation.actions["compress"] == sched.num_swap_outs  # every one int8
    assert ccore.executor.kv_cache.swap_space is not None
    agree, err = agreement(ref, got)
    assert agree >= 0.9 and 0 < err <= 0.05, (agree, err)


def test_the_slotted_swap_space_is_exact_without_compression(tiny_llama_dir):
    ref, _ = run(tiny_llama_dir)
    core = make_engine(tiny_llama_dir, enable_degradation=True, **PRESSURE)
    assert core.scheduler.kv.swap_layout.slots_per_block > 1  # level 2 could compress ...
    core.scheduler.degradation.config.enabled = False  # ... but the level stays at 0
    add(core)
    got = finish(core)
    assert core.scheduler.num_swap_outs > 0
    assert core.scheduler.degradation.actions["compress"] == 0
    assert got == ref  # tokens and logprobs


def test_abort_of_a_compressed_swapped_request_leaks_nothing(tiny_llama_dir):
    core = make_engine(tiny_llama_dir, swap_space_dtype="int8", **PRESSURE)
    kv = core.scheduler.kv
    free_blocks, free_slots = kv.pool.num_free_blocks, len(kv.free_cpu_blocks)
    add(core)
    out: dict = {}
    victim = None
    for _ in range(5000):
        for o in core.step().outputs:
            out.setdefault(o.request_id, []).append(o)
        if kv.swapped_compressed:
            victim = sorted(kv.swapped_compressed)[0]
            break
    assert victim is not None
    core.abort_requests([victim])
    finish(core)
    assert victim not in kv.req_to_cpu_blocks and not kv.swapped_compressed
    assert kv.pool.num_free_blocks == free_blocks
    assert len(kv.free_cpu_blocks) == free_slots
    assert core.scheduler.get_stats().kv_cache_usage == 0.0


def test_degradation_level_two_compresses_swaps_on_the_real_engine(tiny_llama_dir):
    ref, _ = run(tiny_llama_dir)
    core = make_engine(tiny_llama_dir, enable_degradation=True, **PRESSURE)
    deg = core.scheduler.degradation
    deg.config.up_interval = 1  # reach level 2 within this short run
    add(core)
    levels: set[int] = set()
    out: dict = {}
    for _ in range(5000):
        if not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            out.setdefault(o.request_id, []).extend((e[0], e[1]) for e in o.new_logprobs)
        levels.add(deg.level)
    assert 2 in levels and deg.actions["compress"] > 0
    assert deg.actions["compress"] < core.scheduler.num_swap_outs  # level 0-1 swaps stayed exact
    agree, err = agreement(ref, out)
    assert agree >= 0.9 and err <= 0.05, (agree, err)
    kv = core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert len(kv.free_cpu_blocks) == kv.num_cpu_blocks


def test_a_draft_model_cache_follows_compressed_swaps(tiny_llama_dir):
    """The target as its own draft, over int8 swaps: the draft's cache has the same slotted
    swap space (its own slot size), and its drafts are still accepted."""
    import json

    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 3,
                       "model": str(tiny_llama_dir), "adaptive": False})
    core = make_engine(tiny_llama_dir, speculative_config=spec, swap_space_dtype="int8",
                       num_gpu_blocks=26, preemption_mode="swap")
    for i, p in enumerate(PROMPTS[:4]):  # (no logprobs: they turn speculation off)
        core.add_request(EngineCoreRequest(str(i), p * 3, SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), eos_token_id=2))
    for _ in range(5000):
        if not core.has_unfinished_requests():
            break
        core.step()
    sched = core.scheduler
    assert sched.degradation.actions["compress"] > 0
    draft_kv = core.executor.runner.spec_decode.proposer.kv
    assert draft_kv.swap_space is not None and draft_kv.swap_layout == sched.kv.swap_layout
    stats = sched.spec_stats
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens > 0
    assert len(sched.kv.free_cpu_blocks) == sched.kv.num_cpu_blocks
