"""--kv-cache-dtype on the real engine: int8 (and bfloat16) KV greedy outputs stay close to
float32 KV ones, more blocks fit the same --kv-cache-memory, and swap preemption, chunked
prefill and block moves keep working on an int8 cache."""
from __future__ import annotations

import pytest
import torch

from exactness_helpers import make_engine, random_prompts
from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.factory import kv_cache_blocks
from llmtower.kernels.kv_quant import row_width
from llmtower.models.loader import load_model_config
from tests.fixtures.tiny_models import make_tiny_model_dir

MAX_TOKENS = 16
PROMPTS = random_prompts(8, 5, 40, seed=11)
# A tight pool (swap preemptions) and small chunks (prefills that read their earlier chunks
# back from the int8 cache).
PRESSURE = dict(num_gpu_blocks=40, preemption_mode="swap", max_num_batched_tokens=16,
                long_prefill_token_threshold=8, max_num_partial_prefills=2)


def run(model_dir, prompts=PROMPTS, **kw) -> tuple[dict[str, list[tuple[int, float]]], object]:
    """Greedy (token, logprob) per request."""
    core = make_engine(model_dir, **kw)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), p, SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0), eos_token_id=2))
    out: dict[str, list[tuple[int, float]]] = {}
    for _ in range(5000):
        if not core.has_unfinished_requests():
            return out, core
        for o in core.step().outputs:
            out.setdefault(o.request_id, []).extend((e[0], e[1]) for e in o.new_logprobs)
    raise AssertionError("the engine did not finish its requests")


def compare(ref, got) -> tuple[float, float]:
    """(share of tokens equal to the reference up to each request's first divergence,
    max |logprob error| over those tokens)."""
    same, total, err = 0, 0, 0.0
    for rid, want in ref.items():
        total += len(want)
        for (t0, lp0), (t1, lp1) in zip(want, got[rid]):
            if t0 != t1:
                break
            same += 1
            err = max(err, abs(lp0 - lp1))
    return same / total, err


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return run(tiny_llama_dir)[0]  # float32 model, float32 KV


@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize("kv_dtype,max_err", [("int8", 0.02), ("bfloat16", 0.02)])
def test_greedy_outputs_stay_close_to_float32_kv(tiny_llama_dir, reference, backend, kv_dtype,
                                                 max_err):
    got, core = run(tiny_llama_dir, kv_cache_dtype=kv_dtype, attention_backend=backend)
    assert core.executor.kv_cache.kv_caches[0].dtype == getattr(torch, kv_dtype)
    agreement, err = compare(reference, got)
    assert agreement >= 0.9, agreement
    assert 0 < err <= max_err, err  # not 0: the cache really is narrower


def test_int8_kv_under_swap_and_chunked_prefill(tiny_llama_dir, reference):
    got, core = run(tiny_llama_dir, kv_cache_dtype="int8", **PRESSURE)
    assert core.scheduler.num_swap_outs > 0
    agreement, err = compare(reference, got)
    assert agreement >= 0.9 and err <= 0.02, (agreement, err)
    # Block moves copy the scales with the values: moving every step changes no token.
    moved, mcore = run(tiny_llama_dir, kv_cache_dtype="int8", kv_allocator="relocator",
                       fragmentation_threshold=0.0, max_block_moves_per_step=6, **PRESSURE)
    assert mcore.scheduler.relocator.num_moves_total > 10
    assert {k: [t for t, _ in v] for k, v in moved.items()} == \
        {k: [t for t, _ in v] for k, v in got.items()}


def test_same_memory_holds_twice_and_almost_four_times_the_blocks(tiny_llama_dir):
    config = load_model_config(tiny_llama_dir)

    def blocks(kv_dtype: str, dtype: str = "float32") -> int:
        args = EngineArgs(model=str(tiny_llama_dir), kv_cache_memory="8MiB", block_size=16,
                          kv_cache_dtype=kv_dtype, dtype=dtype)
        return kv_cache_blocks(args, config, getattr(torch, dtype))[0]

    f32 = blocks("auto")
    assert blocks("bfloat16") in (2 * f32, 2 * f32 + 1)
    # int8: 1 byte a value plus 4-byte scales (head_dim 16 here, one scale: 20 bytes vs 64)
    d = config.head_dim
    assert abs(blocks("int8") - f32 * 4 * d / row_width(d, torch.int8)) <= 1
    assert blocks("int8", "bfloat16") > blocks("auto", "bfloat16")


@pytest.fixture(scope="module")
def head_dim_64_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny Llama whose head_dim (64) spans two int8 scale groups of 32 channels."""
    return make_tiny_model_dir(tmp_path_factory, hidden_size=128, num_heads=2, num_kv_heads=1,
                               tokenizer_dir=tiny_tokenizer_dir, seed=3)


def test_grouped_scales_at_head_dim_64(head_dim_64_dir):
    ref, _ = run(head_dim_64_dir, prompts=PROMPTS[:4])
    for backend in ("c", "torch"):
        got, core = run(head_dim_64_dir, prompts=PROMPTS[:4], kv_cache_dtype="int8",
                        attention_backend=backend)
        assert core.executor.kv_cache.kv_caches[0].shape[-1] == 64 + 2 * 4
        agreement, err = compare(ref, got)
        assert agreement >= 0.9 and 0 < err <= 0.02, (backend, agreement, err)
