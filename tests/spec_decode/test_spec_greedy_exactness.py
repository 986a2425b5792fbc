"""Greedy decoding with speculation gives exactly the tokens of decoding without it, whatever
the scheduler does meanwhile: preemption by recompute or swap, chunked prefill with a tiny
budget (which also cuts drafts short), prefix-cache hits, small blocks."""
from __future__ import annotations

import pytest

from spec_helpers import (add_requests, assert_nothing_held, copy_prompts, make_engine, run_all,
                          spec_json)

# batch_gate off: these batches run in lock step, where the gate (tested in
# test_spec_batch_gate.py) soon stops drafting; here the drafts' mechanics are under test.
METHODS = {
    "ngram": lambda _d: spec_json("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=4,
                                  batch_gate=False),
    "suffix": lambda _d: spec_json("suffix", 6, batch_gate=False),
    # The target as its own draft: every greedy draft should be accepted, which holds only if
    # the draft's KV cache follows the target's through preemption, swaps and cache hits.
    "draft_model": lambda d: spec_json("draft_model", 3, model=str(d)),
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
    core, out = _run(model_dir, METHODS[method](model_dir), scenario)
    assert out == _baselines[key]
    sched = core.scheduler
    assert sched.spec_stats.num_accepted_tokens > 0, "no draft was ever accepted: test is vacuous"
    if method != "draft_model":
        assert sched.spec_stats.num_draft_tokens > sched.spec_stats.num_accepted_tokens
    if method == "draft_model":
        stats = sched.spec_stats
        assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens
    if scenario in ("preemption", "swap"):
        assert sched.num_preemptions > 0
    if scenario == "swap":
        assert sched.num_swap_outs > 0
    if scenario == "prefix_caching":
        assert sched.kv.prefix_cache_hits > 0


def test_small_random_draft_model_keeps_greedy_exact(tiny_llama_dir, tmp_path_factory,
                                                     tiny_tokenizer_dir):
    """A different, smaller random draft (acceptance is meaningless, the mechanics are not):
    whatever it drafts, the output is the target's."""
    from tests.fixtures.tiny_models import make_tiny_model_dir

    draft = make_tiny_model_dir(tmp_path_factory, "llama", tokenizer_dir=tiny_tokenizer_dir,
                                hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                intermediate_size=64, seed=7)
    spec = spec_json("draft_model", 3, model=str(draft), adaptive=False)
    key = ("llama", "preemption")
    if key not in _baselines:
        _baselines[key] = _run(tiny_llama_dir, None, "preemption")[1]
    core, out = _run(tiny_llama_dir, spec, "preemption")
    assert out == _baselines[key]
    assert core.scheduler.spec_stats.num_draft_tokens > 100


def test_draft_model_with_another_vocabulary_is_refused(tiny_llama_dir, tmp_path_factory):
    from tests.fixtures.tiny_models import make_tiny_model_dir

    other = make_tiny_model_dir(tmp_path_factory, "llama", hidden_size=32, num_layers=1)
    import json
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] = 600
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        make_engine(tiny_llama_dir, spec_json("draft_model", 3, model=str(other)))
