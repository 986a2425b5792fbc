"""Greedy decoding with speculation gives exactly the tokens of decoding without it, whatever
the scheduler does meanwhile: preemption by recompute or swap, chunked prefill with a tiny
budget (which also cuts drafts short), prefix-cache hits, small blocks."""
from __future__ import annotations

import pytest

from spec_helpers import (add_requests, assert_nothing_held, copy_prompts, make_engine, run_all,
                          spec_json)

METHODS = {
    "ngram": spec_json("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=4),
    "suffix": spec_json("suffix", 6),
}
SCENARIOS = {
    "plain": {},
    "preemption": dict(num_gpu_blocks=26),
    "swap": dict(num_gpu_blocks=26, preemption_mode="swap"),
    "chunking": dict(max_num_batched_tokens=7),
    "prefix_caching": {},
    "block_size_2": dict(block_size=2),
}
MAX_TOKENS = 40
_baselines: dict[tuple, dict[str, list[int]]] = {}


def _run(model_dir, spec, scenario: str):
    core = make_engine(model_dir, spec, **SCENARIOS[scenario])
    if scenario == "prefix_caching":
        prefix = copy_prompts(1, 99)[0]
        add_requests(core, copy_prompts(3, 1, prefix), MAX_TOKENS)
        first = run_all(core)
        # The second wave hits the blocks of the first (including blocks holding outputs).
        add_requests(core, copy_prompts(3, 2, prefix), MAX_TOKENS, first_id=10)
        out = {**first, **run_all(core)}
    else:
        add_requests(core, copy_prompts(4, 0), MAX_TOKENS)
        out = run_all(core)
    assert_nothing_held(core)
    return core, out


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_tokens_identical_with_speculation(arch, method, scenario, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    key = (arch, scenario)
    if key not in _baselines:
        _baselines[key] = _run(model_dir, None, scenario)[1]
    core, out = _run(model_dir, METHODS[method], scenario)
    assert out == _baselines[key]
    sched = core.scheduler
    assert sched.spec_stats.num_accepted_tokens > 0, "no draft was ever accepted: test is vacuous"
    assert sched.spec_stats.num_draft_tokens > sched.spec_stats.num_accepted_tokens
    if scenario in ("preemption", "swap"):
        assert sched.num_preemptions > 0
    if scenario == "swap":
        assert sched.num_swap_outs > 0
    if scenario == "prefix_caching":
        assert sched.kv.prefix_cache_hits > 0
