"""The fused decode layer (``kernels/decode_layer.c``): through the engine, every step's logits
equal those of the separate kernels bit for bit, in bfloat16 (decode steps of 1-8 rows use it,
larger ones and prefills do not) and in float32 (decode steps of up to 256 rows; steps with a
prefill do not), and bad inputs are refused with clear errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmtower.kernels import decode_layer as DL
from llmtower.kernels.decode_layer import DecodeLayers, LayerParts, decode_layer_error
from llmtower.kernels.gemm_bf16 import gemm_bf16_error
from llmtower.kernels.gemm_f32 import GemmF32Weight
from llmtower.kernels.gemv_bf16 import GemvWeight
from llmtower.models import linear as linear_mod
from llmtower.models import llama
from tests.executor.exactness_helpers import add_greedy, make_engine, random_prompts, run_all
from tests.fixtures.tiny_models import (  # noqa: F401  (pytest finds fixtures by name)
    make_tiny_model_dir,
    tiny_llama_dir,
    tiny_tokenizer_dir,
)

needs_bf16 = pytest.mark.skipif(decode_layer_error(torch.bfloat16) is not None,
                                reason=f"no fused bfloat16 layer here: {decode_layer_error()}")
needs_f32 = pytest.mark.skipif(decode_layer_error(torch.float32) is not None,
                               reason=f"no fused float32 layer here: "
                                      f"{decode_layer_error(torch.float32)}")
# The unwrapped methods (each run below wraps them afresh to record what they see).
_REAL_LOGITS, _REAL_LAYER = llama.LlamaForCausalLM._logits, DecodeLayers.layer


@pytest.fixture(scope="module")
def odd_qwen2_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:  # noqa: F811
    """Four layers with q/k/v biases and sizes that are no multiple of the kernel's tiles
    (hidden 96, 3:1 heads of 32, intermediate 200); norms and biases random too (they are
    ones and zeros at initialization, which would hide a mix-up)."""
    from safetensors.torch import load_file, save_file
    d = make_tiny_model_dir(tmp_path_factory, "qwen2", tokenizer_dir=tiny_tokenizer_dir,
                            hidden_size=96, num_layers=4, num_heads=3, num_kv_heads=1,
                            intermediate_size=200, initializer_range=0.2, seed=3)
    path = d / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        if t.dim() == 1:  # norm weights around 1, biases around 0
            base = 1.0 if name.endswith("norm.weight") else 0.0
            tensors[name] = base + 0.5 * torch.randn(t.shape, generator=g)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return d


def _run(model_dir: Path, prompts: list[list[int]], threads: int, monkeypatch,
         dtype: str = "bfloat16", **engine_kw
         ) -> tuple[dict[str, list[int]], list[torch.Tensor], list[int]]:
    """Greedy tokens, every step's logits, and the row counts of the steps that took the
    fused layer."""
    logits: list[torch.Tensor] = []
    fused_rows: list[int] = []

    def record_logits(self, x):
        out = _REAL_LOGITS(self, x)
        logits.append(out.clone())
        return out

    def record_layer(self, i, h, attn_out, kv_cache):
        if i == 0:
            fused_rows.append(h.shape[0])
        return _REAL_LAYER(self, i, h, attn_out, kv_cache)

    monkeypatch.setattr(llama.LlamaForCausalLM, "_logits", record_logits)
    monkeypatch.setattr(DecodeLayers, "layer", record_layer)
    core = make_engine(model_dir, dtype=dtype, num_threads=threads, **engine_kw)
    add_greedy(core, prompts, 12)
    return run_all(core), logits, fused_rows


@needs_bf16
@pytest.mark.parametrize("n, threads, whole", [(1, 1, True), (1, 2, False), (3, 2, True),
                                              (3, 1, False), (9, 2, True), (64, 2, True),
                                              (200, 1, False), (300, 2, True)])
def test_logits_equal_the_separate_kernels_bit_for_bit(odd_qwen2_dir, monkeypatch, n, threads,
                                                       whole):
    """``whole``: layers 1 .. L-2 run whole in C (attention included), else one fused call
    per layer after a Python attention. Steps of up to 8 rows take the few-row tiles, larger
    ones gemm_bf16's (where it runs; else they keep oneDNN and the separate calls), and steps
    of more than 256 rows the separate calls."""
    prompts = random_prompts(n, 3, 20, seed=n)
    max_rows = linear_mod.GEMV_MAX_ROWS if gemm_bf16_error() is not None \
        else linear_mod.BF16_KERNEL_MAX_ROWS
    monkeypatch.setattr(DL, "WHOLE_LAYERS", whole)
    spans: list[tuple[int, int]] = []
    real_span = DecodeLayers.attend_and_layers

    def record_span(self, first, count, *args):
        spans.append((first, count))
        return real_span(self, first, count, *args)

    monkeypatch.setattr(DecodeLayers, "attend_and_layers", record_span)
    kw = dict(num_gpu_blocks=4096, max_num_batched_tokens=8192, max_num_seqs=512)  # 1 prefill
    tokens, logits, fused_rows = _run(odd_qwen2_dir, prompts, threads, monkeypatch, **kw)
    monkeypatch.setattr(DL, "MAX_ROWS", 0)  # off: the separate kernels of every op
    tokens_off, logits_off, fused_off = _run(odd_qwen2_dir, prompts, threads, monkeypatch, **kw)
    assert fused_off == []
    # Every decode step of up to max_rows rows took it (11 after the prefill: 12 tokens
    # each); prefills and larger steps did not.
    assert fused_rows == ([] if n > max_rows else [n] * 11)
    # Four layers: layer 0 and 3 from Python, 1 and 2 whole in C.
    assert spans == ([(1, 2)] * 11 if whole and n <= max_rows else [])
    assert tokens == tokens_off
    assert len(logits) == len(logits_off)
    for a, b in zip(logits, logits_off):
        assert torch.equal(a, b)


def test_the_model_uses_it_only_where_it_runs(odd_qwen2_dir, tiny_llama_dir):  # noqa: F811
    from llmtower.models.loader import load_model_config, load_state_dict
    for d in (odd_qwen2_dir, tiny_llama_dir):
        cfg = load_model_config(d)
        for dtype in (torch.bfloat16, torch.float32):
            m = llama.LlamaForCausalLM(cfg, load_state_dict(d, dtype), dtype, 64)
            if decode_layer_error(dtype) is None:
                assert m.decode_layers is not None and m.decode_layers.dtype == dtype
            else:
                assert m.decode_layers is None
        m = llama.LlamaForCausalLM(cfg, load_state_dict(d, torch.float16), torch.float16, 64)
        assert m.decode_layers is None


def _parts(hidden=64, inter=96, nh=2, nkv=1, d=32, dtype=torch.bfloat16) -> LayerParts:
    g = torch.Generator().manual_seed(0)
    kind = GemvWeight if dtype == torch.bfloat16 else GemmF32Weight

    def w(n, k):
        return torch.randn(n, k, generator=g).to(dtype)
    qkv_n = (nh + 2 * nkv) * d
    ones = torch.ones(hidden, dtype=dtype)
    return LayerParts(kind(w(hidden, nh * d)), None, ones, kind(w(inter, hidden), w(inter, hidden)),
                      kind(w(hidden, inter)), ones, kind(w(qkv_n, hidden)), None)


@needs_bf16
def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="expected"):
        DecodeLayers([_parts(inter=128)], 64, 96, 2, 1, 32, 1e-6)  # MLP width off
    bad = _parts()
    bad.post_norm = torch.ones(64)  # float32
    with pytest.raises(ValueError, match="bfloat16"):
        DecodeLayers([bad], 64, 96, 2, 1, 32, 1e-6)
    layers = DecodeLayers([_parts()], 64, 96, 2, 1, 32, 1e-6)
    pos = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(TypeError, match="rotary tables"):
        layers.begin_step(1, torch.ones(8, 32), torch.ones(8, 32), pos, pos)
    layers.begin_step(1, torch.ones(8, 32).bfloat16(), torch.ones(8, 32).bfloat16(), pos, pos)
    h = torch.zeros(1, 64).bfloat16()
    cache = torch.zeros(2, 1, 4, 1, 32).bfloat16()
    with pytest.raises(ValueError, match="unit-stride"):
        layers.layer(0, h, torch.zeros(64, 2).bfloat16().T[:1], cache)
    with pytest.raises(ValueError, match="row count"):
        layers.layer(0, h, torch.zeros(2, 64).bfloat16(), cache)


@needs_f32
def test_bad_float32_inputs_are_refused():
    with pytest.raises(TypeError, match="GemmF32Weight"):  # bfloat16 kernel's matrices
        DecodeLayers([_parts()], 64, 96, 2, 1, 32, 1e-6, torch.float32)
    bad = _parts(dtype=torch.float32)
    bad.next_norm = torch.ones(64).bfloat16()
    with pytest.raises(ValueError, match="float32"):
        DecodeLayers([bad], 64, 96, 2, 1, 32, 1e-6, torch.float32)
    with pytest.raises(ValueError, match="float16"):
        DecodeLayers([_parts(dtype=torch.float32)], 64, 96, 2, 1, 32, 1e-6, torch.float16)
    layers = DecodeLayers([_parts(dtype=torch.float32)], 64, 96, 2, 1, 32, 1e-6, torch.float32)
    pos = torch.zeros(300, dtype=torch.int64)
    cos = torch.ones(8, 32)
    with pytest.raises(TypeError, match="rotary tables"):
        layers.begin_step(1, cos.bfloat16(), cos.bfloat16(), pos[:1], pos[:1])
    with pytest.raises(ValueError, match="rows"):
        layers.begin_step(300, cos, cos, pos, pos)
    layers.begin_step(2, cos, cos, pos[:2], pos[:2])
    h = torch.zeros(2, 64)
    cache = torch.zeros(2, 1, 4, 1, 32)
    with pytest.raises(ValueError, match="row count"):
        layers.layer(0, h, torch.zeros(3, 64), cache)


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:  # noqa: F811
    """Three layers, tied embeddings, GQA 4:2, head_dim 16."""
    return make_tiny_model_dir(tmp_path_factory, "llama", tie=True, tokenizer_dir=tiny_tokenizer_dir,
                               hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                               intermediate_size=120, initializer_range=0.2, seed=7)


@needs_f32
@pytest.mark.parametrize("model, n, threads, whole", [
    ("odd_qwen2_dir", 1, 1, True), ("odd_qwen2_dir", 7, 2, False), ("odd_qwen2_dir", 64, 2, True),
    ("odd_qwen2_dir", 200, 1, True), ("tied_llama_dir", 7, 1, True),
    ("tied_llama_dir", 64, 2, False)])
def test_float32_logits_equal_the_separate_kernels_bit_for_bit(request, monkeypatch, model, n,
                                                               threads, whole):
    """float32 decode steps of 1 to 200 rows (mixed context lengths), Qwen2 with biases and
    odd sizes, Llama tied; ``whole`` as for bfloat16. Fused and unfused take the same kernels,
    so the logits (and tokens) are equal bit for bit."""
    model_dir = request.getfixturevalue(model)
    prompts = random_prompts(n, 3, 30, seed=n)
    monkeypatch.setattr(DL, "WHOLE_LAYERS", whole)
    kw = dict(dtype="float32", num_gpu_blocks=2048, max_num_batched_tokens=8192)  # 1 prefill
    tokens, logits, fused_rows = _run(model_dir, prompts, threads, monkeypatch, **kw)
    monkeypatch.setattr(DL, "MAX_ROWS", 0)
    tokens_off, logits_off, fused_off = _run(model_dir, prompts, threads, monkeypatch, **kw)
    assert fused_off == []
    assert fused_rows == [n] * 11  # every decode step after the prefill
    assert tokens == tokens_off
    assert len(logits) == len(logits_off)
    for a, b in zip(logits, logits_off):
        assert torch.equal(a, b)


@needs_f32
def test_float32_steps_with_a_prefill_take_the_separate_kernels(odd_qwen2_dir, monkeypatch):
    """Chunked prefills beside running decodes (a small token budget): those steps take the
    separate kernels, the pure decode steps the fused layer, and the tokens are those of the
    separate kernels everywhere."""
    prompts = random_prompts(6, 20, 60, seed=11)
    calls: list[tuple[bool, int]] = []  # (the step has a prefill, begin_step was called)
    real_fused, real_begin = llama.LlamaForCausalLM._forward_fused, DecodeLayers.begin_step

    def record_fused(self, fo, input_ids, positions, kv_caches, attn, meta, logits_indices):
        calls.append((bool(meta.prefills), False))
        return real_fused(self, fo, input_ids, positions, kv_caches, attn, meta, logits_indices)

    def record_begin(self, *args):
        calls[-1] = (calls[-1][0], True)
        return real_begin(self, *args)

    monkeypatch.setattr(llama.LlamaForCausalLM, "_forward_fused", record_fused)
    monkeypatch.setattr(DecodeLayers, "begin_step", record_begin)
    kw = dict(dtype="float32", max_num_batched_tokens=24, max_num_seqs=6)
    tokens, logits, _ = _run(odd_qwen2_dir, prompts, 2, monkeypatch, **kw)
    steps = list(calls)
    monkeypatch.setattr(DL, "MAX_ROWS", 0)
    tokens_off, logits_off, _ = _run(odd_qwen2_dir, prompts, 2, monkeypatch, **kw)
    assert any(p and not fused for p, fused in steps[:len(steps) // 2])  # mixed steps happened
    assert all(fused != prefill for prefill, fused in steps)
    assert tokens == tokens_off
    assert all(torch.equal(a, b) for a, b in zip(logits, logits_off, strict=True))
