"""Greedy outputs equal transformers' generate() token for token, whatever the engine did:
batching, preemption by recompute or swap, chunked prefill, prefix caching."""
from __future__ import annotations

import pytest

from exactness_helpers import add_greedy, hf_greedy, make_engine, random_prompts, run_all

MAX_TOKENS = 24
PROMPTS = random_prompts(16, 3, 60, seed=1)
# Prefix-caching prompts: 16 prompts sharing 40 leading tokens (10 blocks of 4).
SHARED = random_prompts(1, 40, 40, seed=2)[0]
PREFIXED = random_prompts(16, 1, 20, seed=3, prefix=SHARED)

CONDITIONS = {
    "ample": dict(),
    # 40 blocks of 4 tokens: the batch needs far more, so the scheduler must preempt.
    "recompute": dict(num_gpu_blocks=40, preemption_mode="recompute"),
    "swap": dict(num_gpu_blocks=40, preemption_mode="swap"),
    "chunked": dict(max_num_batched_tokens=16, long_prefill_token_threshold=8,
                    max_num_partial_prefills=2),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    return model_dir, hf_greedy(model_dir, PROMPTS, MAX_TOKENS), hf_greedy(model_dir, PREFIXED, MAX_TOKENS)


@pytest.mark.parametrize("backend", ["c", "torch"])  # decode attention: C kernel, pure PyTorch
@pytest.mark.parametrize("condition", list(CONDITIONS))
def test_greedy_matches_transformers(model, condition, backend):
    model_dir, expected, _ = model
    core = make_engine(model_dir, attention_backend=backend, **CONDITIONS[condition])
    assert core.executor.runner.attn.backend == backend
    add_greedy(core, PROMPTS, MAX_TOKENS)
    out = run_all(core)
    assert [out[str(i)] for i in range(len(PROMPTS))] == expected
    sched = core.scheduler
    if condition == "recompute":
        assert sched.num_preemptions > 0 and sched.num_swap_outs == 0
    if condition == "swap":
        assert sched.num_swap_outs > 0 and sched.num_swap_ins > 0
    if condition == "chunked":
        assert sched.num_steps > sum(len(p) for p in PROMPTS) // 16


def test_prefix_caching_matches_transformers(model):
    model_dir, _, expected = model
    core = make_engine(model_dir)
    # The first request fills and caches the shared blocks; the others then hit them.
    add_greedy(core, PREFIXED[:1], MAX_TOKENS)
    first = core.step().outputs
    add_greedy(core, PREFIXED[1:], MAX_TOKENS, first_id=1)
    out = run_all(core)
    out["0"] = [t for o in first for t in o.new_token_ids] + out.get("0", [])
    assert [out[str(i)] for i in range(len(PREFIXED))] == expected
    assert core.scheduler.kv.prefix_cache_hits >= 15 * len(SHARED)


def test_prefix_caching_with_preemption_and_chunks_matches_transformers(model):
    """Everything at once: shared prefixes, a tight KV pool, small chunks, swap."""
    model_dir, _, expected = model
    core = make_engine(model_dir, num_gpu_blocks=48, preemption_mode="swap",
                       max_num_batched_tokens=24, long_prefill_token_threshold=12,
                       max_num_partial_prefills=2)
    add_greedy(core, PREFIXED, MAX_TOKENS)
    out = run_all(core)
    assert [out[str(i)] for i in range(len(PREFIXED))] == expected
    assert core.scheduler.num_preemptions > 0 and core.scheduler.kv.prefix_cache_hits > 0


@pytest.mark.parametrize("backend", ["c", "torch"])
def test_bfloat16_greedy_follows_transformers_bfloat16(tiny_llama_dir, backend):
    """bfloat16 rounds differently in every implementation, so near-ties may break the other
    way and a sequence may diverge from there on; but most sequences must match transformers'
    bfloat16 generate() whole (a wrong kernel or cache layout would match almost nothing)."""
    import torch

    expected = hf_greedy(tiny_llama_dir, PROMPTS, MAX_TOKENS, torch.bfloat16)
    core = make_engine(tiny_llama_dir, dtype="bfloat16", attention_backend=backend,
                       num_gpu_blocks=40, preemption_mode="recompute")
    add_greedy(core, PROMPTS, MAX_TOKENS)
    out = run_all(core)
    got = [out[str(i)] for i in range(len(PROMPTS))]
    assert core.scheduler.num_preemptions > 0
    assert sum(g == e for g, e in zip(got, expected)) >= 12, (got, expected)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llama_dir):
    from llmtower.core.outputs import EngineCoreRequest
    from llmtower.core.sampling_params import SamplingParams

    def sample(seed: int, others: int) -> list[int]:
        core = make_engine(tiny_llama_dir)
        core.add_request(EngineCoreRequest("seeded", PROMPTS[0], SamplingParams(
            temperature=1.0, top_p=0.9, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)))
        for i in range(others):  # unseeded, other seeds, greedy: different prompts and lengths
            sp = SamplingParams(temperature=[0.8, 1.0, 0.0][i % 3], seed=[None, 7, None][i % 3],
                                top_k=[0, 20, 0][i % 3], max_tokens=MAX_TOKENS - 2 * i, ignore_eos=True)
            core.add_request(EngineCoreRequest(f"other{i}", PROMPTS[i + 1], sp))
        return run_all(core)["seeded"]

    alone = sample(1234, 0)
    assert len(alone) == MAX_TOKENS
    assert sample(1234, 5) == alone
    assert sample(4321, 5) != alone


def test_default_smollm2_matches_transformers(smollm2_float32_dir):
    from transformers import AutoTokenizer

    from llmtower.models.loader import resolve_model_path

    try:
        path = resolve_model_path(None)
    except FileNotFoundError as e:
        pytest.skip(f"the default model is not installed: {e}")
    tok = AutoTokenizer.from_pretrained(str(path))
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    prompts = [tok(t)["input_ids"] for t in texts]
    core = make_engine(path, block_size=16, num_gpu_blocks=64, max_model_len=128)
    add_greedy(core, prompts, 12)
    out = run_all(core)
    # Served from the GGUF; transformers reads the float32 folder the converter writes on request.
    assert [out[str(i)] for i in range(len(prompts))] == hf_greedy(smollm2_float32_dir, prompts, 12)
