"""Models other than the default SmolLM2 through the whole engine, on every fast path.

SmolLM2's shapes (hidden 576, head_dim 64, 9:3 heads, everything a multiple of 64) hide shape
bugs; these tiny random-weight models do not: Qwen2 with q/k/v biases and Qwen2-0.5B's own
shapes (896 / 4864, 14:2 heads, tied embeddings), hidden and intermediate sizes and vocabularies
that are not multiples of 64 (or of 16), head_dim 32 / 40 / 96 / 128, GQA ratios 1, 2, 4, 7,
Llama with attention biases, Qwen3 with q/k norms, Phi-3 with fused projections, Mistral with a sliding window, llama3 RoPE scaling under a small
max_position_embeddings. For each, through a real EngineCore with chunked prefill and prefix
caching on:

- float32: greedy outputs equal transformers' token for token;
- bfloat16: greedy outputs follow transformers' bfloat16 ones, one request at a time (decode
  GEMMs on the few-row kernel ``kernels/gemv_bf16.c``) and twelve at once (oneDNN);
- float32 with ``--kv-cache-dtype int8`` / ``bfloat16``: greedy outputs follow transformers';
- ``--quantization int8`` / ``int4`` (and a Qwen2 GGUF kept quantized): the model runs, and
  its logits are those of the float model with the weights its integers stand for;
- a prompt just short of the model's limit ends there, token-exact.

Features the model code does not implement are refused by name (RoPE scaling types).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from llmtower.engine.core import EngineCore
from llmtower.kernels import ops
from llmtower.models.config import ModelConfig
from llmtower.models.linear import PackedWeight
from llmtower.models.llama import LlamaForCausalLM
from llmtower.models.loader import load_model_config, load_state_dict
from llmtower.models.quant import QuantizedLinear
from tests.executor.exactness_helpers import (add_greedy, hf_greedy, make_engine, random_prompts,
                                              run_all)
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.models.test_quant import _close_to_reference, _logits

MAX_TOKENS = 8
# Twelve prompts: decode steps of twelve rows (past the few-row kernel's 8).
PROMPTS = random_prompts(12, 3, 30, seed=11)
# Asked after PROMPTS on the same engine: 12 shared tokens (3 blocks of 4) are cached by then.
SHARED = random_prompts(1, 12, 12, seed=12)[0]
PREFIXED = random_prompts(4, 1, 6, seed=13, prefix=SHARED)
# Chunked prefill: at most 32 tokens a step, 16 per request, two partial prefills at once.
CHUNKED = dict(max_num_batched_tokens=32, long_prefill_token_threshold=16,
               max_num_partial_prefills=2)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# name -> make_tiny_model_dir arguments. Vocabularies of 600 are not multiples of 64 and exceed
# the tokenizer's 512, as Qwen2's padded vocabulary does.
VARIANTS: dict[str, dict[str, Any]] = {
    # Qwen2-0.5B's shapes, one layer: GQA 7, intermediate 4864 (76 tiles of 64), tied
    # embeddings, rope_theta 1e6.
    "qwen2_0.5b_shapes": dict(arch="qwen2", tie=True, hidden_size=896, intermediate_size=4864,
                              num_heads=14, num_kv_heads=2, num_layers=1, vocab_size=600,
                              rope_theta=1_000_000.0),
    # Nothing a multiple of 16: hidden 200, intermediate 344, head_dim 40, no GQA, untied.
    "qwen2_hidden200_hd40": dict(arch="qwen2", hidden_size=200, intermediate_size=344,
                                 num_heads=5, num_kv_heads=5, vocab_size=600),
    "llama_hd128_gqa2": dict(arch="llama", hidden_size=256, intermediate_size=344, num_heads=2,
                             num_kv_heads=1, vocab_size=600),
    "llama_hd32_gqa4_tied": dict(arch="llama", tie=True, hidden_size=256, intermediate_size=200,
                                 num_heads=8, num_kv_heads=2, vocab_size=600),
    # head_dim set apart from hidden / heads (q is 384 wide on a 200-wide residual), with q/k/v
    # and o biases (Llama's attention_bias).
    "llama_hd96_gqa4_bias": dict(arch="llama", hidden_size=200, intermediate_size=344,
                                 num_heads=4, num_kv_heads=1, head_dim=96, vocab_size=600,
                                 extra_config={"attention_bias": True}),
    # Qwen3: per-head RMSNorm of q and k before RoPE (q_norm / k_norm), no q/k/v biases,
    # head_dim 64 set apart from hidden / heads (256 wide q on a 160-wide residual), GQA 2,
    # tied embeddings, as Qwen3-0.6B (whose shapes are 1024 / 3072, 16:8 heads of 128).
    "qwen3_hd64_gqa2_tied": dict(arch="qwen3", tie=True, hidden_size=160, intermediate_size=352,
                                 num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=600,
                                 rope_theta=1_000_000.0, random_norms=True),
    # Phi-3: q/k/v and gate/up stored fused (qkv_proj, gate_up_proj), a sliding window as
    # Phi-3-mini-4k's (2047 there), GQA 3, head_dim 32.
    "phi3_fused_window40": dict(arch="phi3", sliding_window=40, hidden_size=96,
                                intermediate_size=200, num_heads=3, num_kv_heads=1,
                                vocab_size=600, random_norms=True),
    # A window shorter than the longest prompts' contexts (tests/models/test_sliding_window.py
    # goes further past windows).
    "mistral_window48": dict(arch="mistral", sliding_window=48, hidden_size=128,
                             intermediate_size=200, num_heads=4, num_kv_heads=4),
    "llama3_rope_maxpos64": dict(arch="llama", rope_scaling=LLAMA3_SCALING,
                                 max_position_embeddings=64, hidden_size=96, num_heads=3,
                                 num_kv_heads=1, intermediate_size=160),
}

TWO_THREAD_VARIANTS = ("qwen2_0.5b_shapes", "qwen2_hidden200_hd40")


@dataclass
class Variant:
    """One model directory and, computed once each, transformers' greedy outputs for it."""

    name: str
    path: Path
    max_model_len: int  # what the engines here run with
    limit: int  # the model's own: max_position_embeddings
    _refs: dict[torch.dtype, list[list[int]]] = field(default_factory=dict)

    def reference(self, dtype: torch.dtype) -> list[list[int]]:
        """transformers' greedy outputs for PROMPTS then PREFIXED, in ``dtype``."""
        if dtype not in self._refs:
            self._refs[dtype] = hf_greedy(self.path, PROMPTS + PREFIXED, MAX_TOKENS, dtype)
        return self._refs[dtype]

    def engine(self, **kw: Any) -> EngineCore:
        return make_engine(self.path, max_model_len=self.max_model_len, **kw)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory, tiny_tokenizer_dir) -> Variant:
    # max_position_embeddings 96 unless set: the last-position test's prompts stay short.
    kw = {"max_position_embeddings": 96, **VARIANTS[request.param]}
    # A wider initialization than the fixtures' 0.02: logits less flat, fewer near-ties for
    # bfloat16 rounding to break differently.
    path = make_tiny_model_dir(tmp_path_factory, tokenizer_dir=tiny_tokenizer_dir,
                               initializer_range=0.05, **kw)
    limit = kw["max_position_embeddings"]
    return Variant(request.param, path, min(64, limit), limit)


def _generate(core: EngineCore, one_at_a_time: bool) -> list[list[int]]:
    """Greedy outputs of PROMPTS (together, or one request at a time), then of PREFIXED: the
    first of those runs alone and leaves SHARED's blocks in the prefix cache, the other three
    then start from them."""
    got: list[list[int]] = []
    if one_at_a_time:
        for i, p in enumerate(PROMPTS):
            add_greedy(core, [p], MAX_TOKENS, first_id=i)
            got.append(run_all(core)[str(i)])
    else:
        add_greedy(core, PROMPTS, MAX_TOKENS)
        out = run_all(core)
        got = [out[str(i)] for i in range(len(PROMPTS))]
    first = len(PROMPTS)
    add_greedy(core, PREFIXED[:1], MAX_TOKENS, first_id=first)
    got.append(run_all(core)[str(first)])
    add_greedy(core, PREFIXED[1:], MAX_TOKENS, first_id=first + 1)
    out = run_all(core)
    got += [out[str(first + i)] for i in range(1, len(PREFIXED))]
    assert core.scheduler.kv.prefix_cache_hits >= 3 * len(SHARED)
    return got


@pytest.mark.parametrize("threads", [1, 2])
def test_float32_greedy_is_token_exact(variant, threads):
    """Two threads split the C kernels' work (GEMM panels, attention units) differently: the
    sums must not depend on it. (Two threads on the two shapes most unlike SmolLM2's only: an
    OpenMP pair is slow on a loaded machine.)"""
    if threads == 2 and variant.name not in TWO_THREAD_VARIANTS:
        pytest.skip("two threads run on the Qwen2 variants only")
    core = variant.engine(num_threads=threads, **CHUNKED)
    assert max(map(len, PROMPTS)) > CHUNKED["long_prefill_token_threshold"]  # chunks, really
    got = _generate(core, one_at_a_time=False)
    assert got == variant.reference(torch.float32)


def test_generation_stops_at_the_models_last_position(variant):
    """max_model_len is the model's own limit (max_position_embeddings, whatever its window):
    a prompt 4 tokens short of it gets exactly 4 tokens, the last at the last rotary position,
    token-exact, and ends with "length"."""
    from llmtower.core.outputs import EngineCoreRequest
    from llmtower.core.sampling_params import SamplingParams

    core = make_engine(variant.path, max_model_len=0, max_num_batched_tokens=32)
    limit = core.scheduler.config.max_model_len
    assert limit == variant.limit
    prompt = random_prompts(1, limit - 4, limit - 4, seed=14)[0]
    core.add_request(EngineCoreRequest("long", prompt, SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True), eos_token_id=2))
    got, finish = [], None
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            got += o.new_token_ids
            finish = o.finish_reason or finish
    assert finish == "length"
    assert got == hf_greedy(variant.path, [prompt], 4)[0]


@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_float32_with_a_narrower_kv_cache_follows_transformers(variant, kv_dtype):
    """--kv-cache-dtype int8 / bfloat16 under a float32 model: the K/V rounding moves near-ties
    only (its own kernel, ``paged_attention_int8``, reads every head size)."""
    core = variant.engine(kv_cache_dtype=kv_dtype, **CHUNKED)
    got = _generate(core, one_at_a_time=False)
    whole, prefix = _agreement(got, variant.reference(torch.float32))
    assert whole >= len(got) // 2 and prefix >= 0.7, (whole, prefix)


def _agreement(got: list[list[int]], ref: list[list[int]]) -> tuple[int, float]:
    """(sequences equal whole, mean fraction of each sequence equal before it first differs)."""
    prefix = 0
    for g, r in zip(got, ref):
        n = 0
        while n < len(r) and n < len(g) and g[n] == r[n]:
            n += 1
        prefix += n / len(r)
    return sum(g == r for g, r in zip(got, ref)), prefix / len(ref)


@pytest.mark.parametrize("one_at_a_time", [True, False], ids=["one_request", "twelve_requests"])
def test_bfloat16_greedy_follows_transformers_bfloat16(variant, one_at_a_time):
    """bfloat16 rounds differently in every implementation, so near-ties may break the other way
    and a sequence diverge from there; on these models transformers' own bfloat16 outputs
    equal its float32 ones in ~80% of sequences. A wrong kernel, tile edge or bias matches
    almost nothing."""
    core = variant.engine(dtype="bfloat16", **CHUNKED)
    model = core.executor.runner.model
    if ops.capabilities().why_not("gemv_bf16") is None:  # the few-row kernel holds every float matrix
        assert isinstance(model.layers[0].qkv, PackedWeight)
        assert isinstance(model.layers[0].gate, PackedWeight) and model.layers[0].gate.gemv.silu_pair
        assert isinstance(model.lm_head, PackedWeight)
    got = _generate(core, one_at_a_time)
    assert all(len(g) == MAX_TOKENS for g in got)
    whole, prefix = _agreement(got, variant.reference(torch.bfloat16))
    n = len(got)
    assert whole >= n // 2 and prefix >= 0.7, (whole, prefix, got, variant.reference(torch.bfloat16))


def _dequantized_state(model: LlamaForCausalLM, state: dict[str, torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
    """``state`` with every matrix the quantized ``model`` holds replaced by the float32 matrix
    its integers stand for (fused q/k/v and gate/up split again; the int8 output layer)."""
    c = model.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    out = dict(state)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        assert isinstance(layer.qkv, QuantizedLinear) and isinstance(layer.o_proj, QuantizedLinear)
        assert isinstance(layer.down, QuantizedLinear) and layer.gate_up is not None
        qw, kw, vw = layer.qkv.dequantized().float().split([q, kv, kv])
        gate, up = layer.gate_up.dequantized().float().chunk(2)
        out.update({p + "self_attn.q_proj.weight": qw, p + "self_attn.k_proj.weight": kw,
                    p + "self_attn.v_proj.weight": vw, p + "mlp.gate_proj.weight": gate,
                    p + "mlp.up_proj.weight": up,
                    p + "self_attn.o_proj.weight": layer.o_proj.dequantized().float(),
                    p + "mlp.down_proj.weight": layer.down.dequantized().float()})
    assert isinstance(model.lm_head, QuantizedLinear)
    out["lm_head.weight"] = model.lm_head.dequantized().float()
    return out


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_model_loads_runs_and_matches_its_dequantized_weights(variant, kind):
    """The packed integer weights (int4 where torch's kernel takes the shape, else int8; rows
    not a multiple of 16 wide padded for the int8 kernel) multiply as the float matrices they
    stand for: the quantized model is the float model with those weights, up to bfloat16."""
    cfg = load_model_config(variant.path)
    state = load_state_dict(variant.path)
    quantized = LlamaForCausalLM(cfg, dict(state), torch.bfloat16, 64, quantization=kind)
    untied = dataclasses.replace(cfg, tie_word_embeddings=False)  # the int8 head is its own
    reference = LlamaForCausalLM(untied, _dequantized_state(quantized, state), torch.float32, 64)
    for ids in ([t for p in PROMPTS[:2] for t in p][:40], PROMPTS[2][:3]):  # GEMM and GEMV rows
        _close_to_reference(_logits(quantized, ids).float(), _logits(reference, ids))
    core = variant.engine(quantization=kind, dtype="bfloat16", **CHUNKED)
    got = _generate(core, one_at_a_time=False)
    assert all(len(g) == MAX_TOKENS for g in got)


# Variants whose widths are multiples of 32 (GGUF's 4-bit blocks) -> (GGUF architecture,
# queries per KV head).
GGUF_VARIANTS = {"qwen2_0.5b_shapes": ("Qwen2ForCausalLM", 7),
                 "qwen3_hd64_gqa2_tied": ("Qwen3ForCausalLM", 2)}


def test_qwen_gguf_kept_quantized_matches_its_dequantized_model(variant, tmp_path):
    """A Qwen2-0.5B-shaped GGUF (q/k/v biases) and a Qwen3 one (q/k norms, head_dim apart
    from hidden / heads): written in float32 they give transformers' greedy tokens; written as
    llama.cpp quantizes (Q4_1 attention, Q4_0 MLP, Q8_0 embeddings; tied, q/k rows not
    permuted) and run with --quantization gguf, they match the float model of the same file's
    dequantized tensors."""
    import gguf

    from llmtower.models.gguf_loader import gguf_model_config, gguf_state_dict, open_gguf
    from llmtower.models.gguf_quant import gguf_quantized_state_dict
    from tests.fixtures.tiny_gguf import write_gguf_from_hf_dir

    if variant.name not in GGUF_VARIANTS:
        pytest.skip("GGUF's 4-bit blocks need widths in multiples of 32: the Qwen variants")
    arch, group = GGUF_VARIANTS[variant.name]
    f32 = write_gguf_from_hf_dir(variant.path, tmp_path / "f32.gguf")
    core = make_engine(f32, max_model_len=64, **CHUNKED)
    add_greedy(core, PROMPTS, MAX_TOKENS)
    out = run_all(core)
    assert [out[str(i)] for i in range(len(PROMPTS))] == \
        variant.reference(torch.float32)[:len(PROMPTS)]
    q = gguf.GGMLQuantizationType

    def qtype_of(name: str, _w: Any) -> Any:
        return q.Q8_0 if "embed" in name else q.Q4_1 if "self_attn" in name else q.Q4_0

    path = write_gguf_from_hf_dir(variant.path, tmp_path / "qwen2-q4.gguf", qtype_of=qtype_of)
    reader = open_gguf(path)
    cfg = gguf_model_config(reader)
    assert cfg.architecture == arch and cfg.num_queries_per_kv == group
    quantized = LlamaForCausalLM(cfg, gguf_quantized_state_dict(reader, cfg), torch.bfloat16, 64,
                                 quantization="gguf")
    assert isinstance(quantized.layers[0].qkv, QuantizedLinear) and quantized.layers[0].qkv.kind == "int4"
    reference = LlamaForCausalLM(cfg, gguf_state_dict(reader, cfg), torch.float32, 64)
    for ids in ([t for p in PROMPTS[:2] for t in p][:40], PROMPTS[2][:3]):
        _close_to_reference(_logits(quantized, ids).float(), _logits(reference, ids))
    core = make_engine(path, quantization="gguf", dtype="bfloat16", max_model_len=64, **CHUNKED)
    got = _generate(core, one_at_a_time=False)
    assert all(len(g) == MAX_TOKENS for g in got)


@functools.cache
def _llama_config_json() -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 600, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "max_position_embeddings": 128}


@pytest.mark.parametrize("rope", [
    {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},  # Phi-3 128k's kind
    {"type": "su", "factor": 2.0},
])
def test_unsupported_rope_scaling_is_refused_by_name(tmp_path, rope):
    import json

    kind = rope.get("rope_type", rope.get("type"))
    for key in ("rope_scaling", "rope_parameters"):  # legacy and transformers v5 layouts
        (tmp_path / "config.json").write_text(json.dumps({**_llama_config_json(), key: rope}))
        with pytest.raises(ValueError, match=f"rope scaling type '{kind}' is not supported"):
            ModelConfig.from_hf_config(tmp_path)
