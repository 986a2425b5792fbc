"""Sliding-window models (Mistral, Phi-3, Qwen2 with use_sliding_window and a global first
layer) through a real EngineCore with prompts and generations longer than the window: greedy
outputs equal transformers' token for token in float32, on both attention backends, with
chunked prefill, prefix caching and preemption by recompute and swap."""
from __future__ import annotations

from typing import Any

import pytest

from tests.executor.exactness_helpers import (add_greedy, hf_greedy, make_engine, random_prompts,
                                              run_all)
from tests.fixtures.tiny_models import make_tiny_model_dir

MAX_TOKENS = 16
PROMPTS = random_prompts(6, 17, 50, seed=21)  # every one longer than every window
SHARED = random_prompts(1, 24, 24, seed=22)[0]  # 6 blocks of 4, more than a window
PREFIXED = random_prompts(3, 3, 20, seed=23, prefix=SHARED)

MODELS: dict[str, dict[str, Any]] = {
    "mistral_w16": dict(arch="mistral", sliding_window=16),
    "phi3_w13": dict(arch="phi3", sliding_window=13, num_kv_heads=4),
    # layer 0 global, layer 1 windowed (transformers: from max_window_layers on)
    "qwen2_w10_mixed": dict(arch="qwen2", extra_config={
        "use_sliding_window": True, "sliding_window": 10, "max_window_layers": 1}),
}
CONDITIONS: dict[str, dict[str, Any]] = {
    "torch": dict(attention_backend="torch"),
    "chunked": dict(max_num_batched_tokens=16, long_prefill_token_threshold=8,
                    max_num_partial_prefills=2),
    # A pool this tight preempts even where requests keep only their windows' blocks: chunked
    # prefills hold blocks across steps.
    "recompute": dict(num_gpu_blocks=18, preemption_mode="recompute", max_num_batched_tokens=24,
                      long_prefill_token_threshold=12),
    "swap": dict(num_gpu_blocks=18, preemption_mode="swap", max_num_batched_tokens=24,
                 long_prefill_token_threshold=12),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory, tiny_tokenizer_dir):
    path = make_tiny_model_dir(tmp_path_factory, tokenizer_dir=tiny_tokenizer_dir,
                               initializer_range=0.05, max_position_embeddings=128,
                               **MODELS[request.param])
    return request.param, path, hf_greedy(path, PROMPTS + PREFIXED, MAX_TOKENS)


def test_windows_are_read_from_the_config(model):
    name, path, _ = model
    core = make_engine(path, max_model_len=0)
    windows = core.executor.runner.model.windows
    assert windows == {"mistral_w16": [16, 16], "phi3_w13": [13, 13],
                       "qwen2_w10_mixed": [None, 10]}[name]
    assert core.scheduler.config.max_model_len == 128  # not capped by the window


@pytest.mark.parametrize("condition", list(CONDITIONS))
def test_greedy_matches_transformers_past_the_window(model, condition):
    _, path, expected = model
    core = make_engine(path, max_model_len=128, **CONDITIONS[condition])
    add_greedy(core, PROMPTS, MAX_TOKENS)
    out = run_all(core)
    assert [out[str(i)] for i in range(len(PROMPTS))] == expected[:len(PROMPTS)]
    if condition in ("recompute", "swap"):
        assert core.scheduler.num_preemptions > 0
    assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.pool.num_blocks


def test_prefix_caching_past_the_window_matches_transformers(model):
    """The first request caches SHARED's blocks (longer than the window); the others start
    from them, their first chunk attending across the cached context's window."""
    _, path, expected = model
    core = make_engine(path, max_model_len=128, max_num_batched_tokens=16,
                       long_prefill_token_threshold=8)
    add_greedy(core, PREFIXED[:1], MAX_TOKENS)
    got = run_all(core)
    add_greedy(core, PREFIXED[1:], MAX_TOKENS, first_id=1)
    got.update(run_all(core))
    assert [got[str(i)] for i in range(len(PREFIXED))] == expected[len(PROMPTS):]
    assert core.scheduler.kv.prefix_cache_hits >= 2 * len(SHARED)


def test_a_long_generation_holds_only_its_windows_blocks(model):
    """Every layer windowed (Mistral, Phi-3): a request holds at most ceil(window / block) + 2
    blocks in a decode step, however long it runs, and its tokens stay transformers'; with a
    global layer (the Qwen2 model) every block stays."""
    name, path, _ = model
    prompt = random_prompts(1, 20, 20, seed=24)[0]
    core = make_engine(path, max_model_len=128, num_gpu_blocks=64)
    window = core.executor.runner.model.windows[-1]
    kv, sched = core.scheduler.kv, core.scheduler
    most = 0
    schedule = sched.schedule

    def watched():
        nonlocal most
        so = schedule()
        most = max([most] + [kv.num_blocks_of(r) for r, n in so.num_scheduled_tokens.items()
                             if n == 1])
        return so

    sched.schedule = watched
    add_greedy(core, [prompt], 60)
    got = run_all(core)["0"]
    assert got == hf_greedy(path, [prompt], 60)[0]
    if name == "qwen2_w10_mixed":
        assert most == -(-(20 + 60 - 1) // 4)
    else:
        assert most <= -(-window // 4) + 2
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and not kv.num_dead_blocks
