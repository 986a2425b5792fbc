"""Offline ``LLM.generate(..., lora_request=...)``: greedy outputs of each adapter equal
transformers + PEFT on the merged model, with three adapters and the base model batched
together (prefill and decode steps, the fused decode path for base-only steps)."""
from __future__ import annotations

import pytest

from llmtower import LLM, LoRARequest, SamplingParams
from tests.fixtures.lora_adapters import merged_greedy

PROMPTS = [[5, 77, 300, 12, 9, 450, 8, 9, 10], [33, 1, 101, 222, 333], [444, 17, 64, 128, 256],
           [40, 41, 42, 43, 44, 45, 46], [300, 301, 302]]
MAX_TOKENS = 8


def make_llm(model_dir, **kw) -> LLM:
    base = dict(num_threads=1, block_size=4, max_model_len=128, num_gpu_blocks=256, seed=0,
                enable_lora=True, max_loras=3, max_lora_rank=16)
    return LLM(model=str(model_dir), **{**base, **kw})


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_mixed_batch_matches_merged_peft(tiny_llama_dir, tiny_adapters):
    llm = make_llm(tiny_llama_dir)
    reqs = {k: LoRARequest(k, i + 1, str(p)) for i, (k, p) in enumerate(tiny_adapters.items())}
    # Three adapters and the base model in the same steps (max_loras=3).
    per_prompt = [reqs["all"], None, reqs["attn"], reqs["mlp"], reqs["all"]]
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=per_prompt)
    for prompt, lora, out in zip(PROMPTS, per_prompt, outs):
        path = None if lora is None else tiny_adapters[lora.lora_name]
        assert out.outputs[0].token_ids == merged_greedy(tiny_llama_dir, path, [prompt],
                                                         MAX_TOKENS)[0], lora
    # The base model's rows equal a run without LoRA at all.
    plain = LLM(model=str(tiny_llama_dir), num_threads=1, block_size=4, max_model_len=128,
                num_gpu_blocks=256, seed=0)
    assert plain.generate([PROMPTS[1]], greedy(), use_tqdm=False)[0].outputs[0].token_ids \
        == outs[1].outputs[0].token_ids


def test_prefix_cache_never_shared_across_adapters(tiny_llama_dir, tiny_adapters):
    """The same prompt under two adapters: the second must not reuse the first's KV."""
    llm = make_llm(tiny_llama_dir, max_loras=1)
    prompt = list(range(10, 42))  # 8 full blocks
    a = LoRARequest("all", 1, str(tiny_adapters["all"]))
    first = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=a)[0]
    again = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=a)[0]
    base = llm.generate([prompt], greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # same adapter: the prefix is reused
    assert base.num_cached_tokens == 0
    assert base.outputs[0].token_ids == merged_greedy(tiny_llama_dir, None, [prompt],
                                                      MAX_TOKENS)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids


def test_more_adapters_than_max_loras_all_finish(tiny_llama_dir, tiny_adapters):
    """max_loras=1, max_cpu_loras=1: adapters take turns (evicted and read again) and every
    request still gets its own adapter's tokens."""
    llm = make_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=1)
    names = ["all", "attn", "mlp", "all", "attn"]
    loras = [LoRARequest(n, i + 1, str(tiny_adapters[n]))
             for n, i in zip(names, [0, 1, 2, 0, 1])]
    outs = llm.generate(PROMPTS, greedy(4), use_tqdm=False, lora_request=loras)
    for prompt, n, out in zip(PROMPTS, names, outs):
        assert out.outputs[0].token_ids == merged_greedy(tiny_llama_dir, tiny_adapters[n],
                                                         [prompt], 4)[0]


def test_lora_request_without_enable_lora_refused(tiny_llama_dir, tiny_adapters):
    llm = LLM(model=str(tiny_llama_dir), num_threads=1, block_size=4, max_model_len=128,
              num_gpu_blocks=64)
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.generate([PROMPTS[0]], greedy(), use_tqdm=False,
                     lora_request=LoRARequest("all", 1, str(tiny_adapters["all"])))
    # Nothing was left behind: the engine still serves.
    assert llm.generate([PROMPTS[0]], greedy(2), use_tqdm=False)[0].outputs[0].token_ids


def test_bad_adapter_refused_with_reason(tiny_llama_dir, tiny_adapters):
    llm = make_llm(tiny_llama_dir, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16 is above --max-lora-rank=8"):
        llm.generate([PROMPTS[0]], greedy(), use_tqdm=False,
                     lora_request=LoRARequest("mlp", 3, str(tiny_adapters["mlp"])))
    with pytest.raises(ValueError, match="not a directory"):
        llm.generate([PROMPTS[0]], greedy(), use_tqdm=False,
                     lora_request=LoRARequest("x", 4, "/nonexistent/adapter"))
    assert llm.generate([PROMPTS[0]], greedy(2), use_tqdm=False)[0].outputs[0].token_ids


def test_unload_refused_while_in_use_then_allowed(tiny_llama_dir, tiny_adapters):
    from llmtower.core.outputs import EngineCoreRequest

    llm = make_llm(tiny_llama_dir)
    core = llm.engine_core
    lora = LoRARequest("all", 1, str(tiny_adapters["all"]))
    core.add_request(EngineCoreRequest("r", PROMPTS[0], greedy(4), eos_token_id=2,
                                       lora_request=lora))
    core.step()
    with pytest.raises(ValueError, match="in use by 1 unfinished requests"):
        core.remove_lora(1)
    assert core.list_loras() == [1]
    while core.has_unfinished_requests():
        core.step()
    assert core.remove_lora(1) is True
    # The runner lets go of the finished request with the next step that runs: the adapter
    # leaves memory then.
    llm.generate([PROMPTS[1]], greedy(1), use_tqdm=False)
    assert core.list_loras() == []
