"""Quantized weights kept quantized: GGUF blocks read bit for bit, int4/int8 products against the
dequantized matrices, and whole models against the same model with dequantized float weights."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmtower.executor.kv_cache import KVCache
from llmtower.models.attention import AttentionMetadata, PagedAttention, PrefillSeq
from llmtower.models.gguf_dequant import dequantize
from llmtower.models.gguf_loader import gguf_model_config, gguf_state_dict, open_gguf
from llmtower.models.gguf_quant import gguf_quantized_state_dict, quantized_tensor
from llmtower.models.llama import LlamaForCausalLM
from llmtower.models.loader import load_model_config, load_state_dict
from llmtower.models.linear import linear
from llmtower.models.quant import (DEQUANTIZE_MIN_ROWS, QuantizedLinear, QuantizedTensor, pack,
                                   quantize_int4, quantize_int8)
from llmtower.models.quant_loader import load_model_weights, resolve_gguf_path
from tests.fixtures.tiny_gguf import write_gguf_from_hf_dir

Q = gguf.GGMLQuantizationType
IDS = [5, 77, 300, 12, 9, 450, 33, 1, 2, 101, 222, 333, 444, 17, 64, 128, 256, 511, 3, 4] * 3


def _raw(x: np.ndarray, qtype: Q) -> np.ndarray:
    return np.asarray(gguf.quants.quantize(x, qtype))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_int4_gguf_blocks_are_read_bit_for_bit(qtype):
    x = np.random.default_rng(0).normal(0, 1, (32, 96)).astype(np.float32)
    raw = _raw(x, qtype)
    t = quantized_tensor(raw, qtype)
    assert t.kind == "int4" and t.shape == (32, 96) and t.group_size == 32
    assert int(t.q.min()) >= 0 and int(t.q.max()) <= 15
    np.testing.assert_array_equal(t.dequantize().numpy(), dequantize(raw, qtype))


def test_q8_0_becomes_int8_per_row():
    x = np.random.default_rng(1).normal(0, 1, (16, 64)).astype(np.float32)
    raw = _raw(x, Q.Q8_0)
    t = quantized_tensor(raw, Q.Q8_0)
    assert t.kind == "int8" and t.scale.shape == (16, 1)
    ref = dequantize(raw, Q.Q8_0)
    step = np.abs(ref).max(axis=1, keepdims=True) / 127
    assert (np.abs(t.dequantize().numpy() - ref) <= 0.5 * step + 1e-7).all()


def test_quantize_int4_stays_within_half_a_step():
    w = torch.randn(48, 128)
    t = quantize_int4(w)
    err = (t.dequantize() - w).abs().view(48, 4, 32)
    assert (err <= 0.5 * t.scale[..., None] + 1e-6).all()
    w8 = quantize_int8(w)
    assert ((w8.dequantize() - w).abs() <= 0.5 * w8.scale + 1e-6).all()


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_multiplies_by_the_dequantized_matrix(kind, dtype):
    torch.manual_seed(0)
    w = torch.randn(64, 96)
    t = quantize_int4(w) if kind == "int4" else quantize_int8(w)
    lin = pack(t)
    bias = torch.randn(64).to(dtype)
    for rows in (1, 7, DEQUANTIZE_MIN_ROWS + 3):  # the last: dequantized once, oneDNN GEMM
        x = torch.randn(rows, 96).to(dtype)
        y = lin(x, bias)
        assert y.dtype == dtype and y.shape == (rows, 64)
        ref = x.float() @ t.dequantize().T + bias.float()
        # bfloat16 activations and scales: ~3 significant digits.
        torch.testing.assert_close(y.float(), ref, rtol=0.03, atol=0.05 * ref.abs().max().item())


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_many_rows_use_the_weight_dequantized_to_bfloat16_once(kind):
    torch.manual_seed(1)
    t = quantize_int4(torch.randn(64, 96)) if kind == "int4" else quantize_int8(torch.randn(64, 96))
    lin = pack(t)
    # The kernel's values with its bfloat16 scales, rounded once to bfloat16.
    scale = t.scale.to(torch.bfloat16).float()
    if kind == "int4":
        zero = t.zero.to(torch.bfloat16).float()  # type: ignore[union-attr]
        ref = ((t.q.float().view(64, 3, 32) - 8) * scale[..., None] + zero[..., None]).view(64, 96)
    else:
        ref = t.q.float() * scale
    w = lin.dequantized()
    assert w.dtype == torch.bfloat16 and torch.equal(w, ref.to(torch.bfloat16))
    x = torch.randn(DEQUANTIZE_MIN_ROWS, 96, dtype=torch.bfloat16)
    big = lin(x)
    assert torch.equal(big, linear(x, w))
    # Row for row close to what the kernel gives the same rows in smaller products.
    small = torch.cat([lin(x[i:i + 64]) for i in range(0, DEQUANTIZE_MIN_ROWS, 64)])
    torch.testing.assert_close(big.float(), small.float(), rtol=0.02,
                               atol=0.01 * small.abs().max().item())


@pytest.mark.parametrize("k", [8, 24, 100, 200, 344])
def test_int8_input_widths_not_a_multiple_of_16_multiply_correctly(k):
    """torch's int8 kernel reads 16 inputs at a time with no tail: unpadded, K = 200 (a
    hidden size of 200) gave NaNs or crashed the process."""
    torch.manual_seed(k)
    t = quantize_int8(torch.randn(72, k))
    lin = pack(t)
    for rows in (1, 5, 13):
        x = torch.randn(rows, k).to(torch.bfloat16)
        ref = x.float() @ t.dequantize().T
        torch.testing.assert_close(lin(x).float(), ref, rtol=0.03, atol=0.02 * ref.abs().max().item())


def test_int4_shapes_the_kernel_cannot_take_fall_back_to_int8():
    t = quantize_int4(torch.randn(40, 64))  # 40 rows: not a multiple of 16
    assert pack(t).kind == "int8"
    with pytest.raises(ValueError, match="multiples of 16"):
        QuantizedLinear(t)


def test_cat_stacks_rows():
    a, b = quantize_int4(torch.randn(16, 64)), quantize_int4(torch.randn(32, 64))
    both = QuantizedTensor.cat([a, b])
    torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="different kinds"):
        QuantizedTensor.cat([a, quantize_int8(torch.randn(16, 64))])


# ---------------------------------------------------------------------------- whole models
def _logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    cfg, n = model.config, len(ids)
    kv = KVCache(cfg, num_blocks=32, num_cpu_blocks=0, block_size=4, dtype=model.dtype)
    attn = PagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 4,
                          model.dtype, gather_buffer_blocks=32)
    meta = AttentionMetadata(n, torch.arange(n), prefills=[PrefillSeq(0, n, 0)])
    return model(torch.tensor(ids), torch.arange(n), kv.kv_caches, attn, meta, torch.arange(n))


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory, tiny_llama_dir) -> Path:
    """The tiny Llama as a GGUF with Q4_1 attention matrices and Q4_0 MLP matrices (embeddings
    Q8_0), as llama.cpp's converter lays them out (q/k rows permuted)."""
    def qtype_of(name: str, _w: np.ndarray) -> Q:
        if "embed" in name or "lm_head" in name:
            return Q.Q8_0
        return Q.Q4_1 if "self_attn" in name else Q.Q4_0
    return write_gguf_from_hf_dir(tiny_llama_dir, tmp_path_factory.mktemp("q4") / "tiny-q4.gguf",
                                  qtype_of=qtype_of)


def _close_to_reference(got: torch.Tensor, ref: torch.Tensor, mean_rel: float = 0.03) -> None:
    # Random tiny weights: logits ~N(0, 0.15); bfloat16 activations and the int8 output layer
    # move them by ~1e-2 (int4 rounding of the weights themselves: ~7%). A wrong row order,
    # scale or zero point moves them by the logits' own size.
    err = (got - ref).abs()
    assert err.max().item() < 3 * mean_rel / 0.6 * ref.abs().max().item(), err.max().item()
    assert err.mean().item() < mean_rel * ref.abs().mean().item() + 1e-3, err.mean().item()


def test_gguf_model_kept_quantized_matches_its_dequantized_model(q4_gguf):
    reader = open_gguf(q4_gguf)
    cfg = gguf_model_config(reader)
    qstate = gguf_quantized_state_dict(reader, cfg)
    assert isinstance(qstate["model.layers.0.self_attn.q_proj.weight"], QuantizedTensor)
    assert isinstance(qstate["model.embed_tokens.weight"], torch.Tensor)
    quantized = LlamaForCausalLM(cfg, qstate, torch.float32, 256, quantization="gguf")
    layer = quantized.layers[0]
    assert isinstance(layer.qkv, QuantizedLinear) and layer.qkv.kind == "int4"
    assert layer.gate_up is not None and layer.gate is None
    assert isinstance(quantized.lm_head, QuantizedLinear) and quantized.lm_head.kind == "int8"
    fstate = gguf_state_dict(reader, cfg)
    for name, t in qstate.items():  # the same numbers, q/k rows in Hugging Face order
        if isinstance(t, QuantizedTensor):
            assert torch.equal(t.dequantize(), fstate[name]), name
    reference = LlamaForCausalLM(cfg, dict(fstate), torch.float32, 256)
    _close_to_reference(_logits(quantized, IDS), _logits(reference, IDS))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_hf_model_quantized_on_load_stays_close(tiny_llama_dir, kind):
    cfg = load_model_config(tiny_llama_dir)
    state = load_state_dict(tiny_llama_dir)
    quantized = LlamaForCausalLM(cfg, dict(state), torch.bfloat16, 256, quantization=kind)
    assert quantized.layers[1].down.kind == kind  # type: ignore[union-attr]
    reference = LlamaForCausalLM(cfg, dict(state), torch.float32, 256)
    # Against the float model itself: the error is that of rounding the weights.
    _close_to_reference(_logits(quantized, IDS).float(), _logits(reference, IDS),
                        mean_rel=0.03 if kind == "int8" else 0.1)


def test_gguf_quantization_needs_a_gguf_model(tiny_llama_dir):
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_gguf_path(str(tiny_llama_dir))
    with pytest.raises(ValueError, match="quantization='int3'"):
        load_model_weights(None, tiny_llama_dir, torch.float32, "int3")


def test_engine_runs_a_gguf_kept_quantized(q4_gguf):
    from llmtower.core.sampling_params import SamplingParams
    from llmtower.engine.llm import LLM

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(q4_gguf), quantization="gguf", num_threads=1, dtype="bfloat16",
              kv_cache_memory="8MiB")
    outs = llm.generate([[5, 77, 300, 12], [9, 450, 33, 1, 2, 101]], sp, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    # The same prompt alone gives the same tokens as in the batch.
    alone = llm.generate([[9, 450, 33, 1, 2, 101]], sp, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_quantized_output_layer_gives_the_same_logits_alone_and_in_a_large_batch(tiny_llama_dir):
    from llmtower.models.llama import LM_HEAD_QUANTIZED_MAX_ROWS

    cfg = load_model_config(tiny_llama_dir)
    model = LlamaForCausalLM(cfg, dict(load_state_dict(tiny_llama_dir)), torch.bfloat16, 64,
                             quantization="int4")
    torch.manual_seed(0)
    x = torch.randn(LM_HEAD_QUANTIZED_MAX_ROWS + 8, cfg.hidden_size).to(torch.bfloat16)
    alone = torch.cat([model._logits(x[i:i + 1]) for i in range(len(x))])  # int8 kernel
    together = model._logits(x)  # the float GEMM over the int8 matrix's exact values
    # Both round to bfloat16: equal up to a rounding step where the sums' order differs.
    torch.testing.assert_close(together, alone, rtol=2 ** -7, atol=1e-5)
    assert (together == alone).float().mean() > 0.9
    assert torch.equal(together.argmax(-1), alone.argmax(-1))


def test_gguf_blocks_stay_in_the_files_formats(q4_gguf):
    """--quantization gguf: every matrix in its block format (q/k/v in one Q4_1 buffer, gate/up
    in one Q4_0, the Q8_0 embeddings and output layer as they are), close to the float model of
    the same file's dequantized tensors; the float path's tensors are gguf's values exactly."""
    from llmtower.models.gguf_weights import gguf_block_state_dict, gguf_float_state_dict
    from llmtower.models.quant_block import BlockEmbedding, BlockQuantLinear, GGUFMatrix
    from llmtower.kernels import ops

    if not ops.capabilities().can_run("quant_gemm"):
        pytest.skip(ops.capabilities().why_not("quant_gemm"))
    cfg = gguf_model_config(open_gguf(q4_gguf))
    state = gguf_block_state_dict(q4_gguf, cfg)
    assert isinstance(state["model.layers.0.self_attn.q_proj.weight"], GGUFMatrix)
    model = LlamaForCausalLM(cfg, state, torch.float32, 256, quantization="gguf")
    layer = model.layers[0]
    assert isinstance(layer.qkv, BlockQuantLinear)
    assert [p.fmt for p in layer.qkv.parts] == [int(Q.Q4_1)]  # one run: one buffer
    assert isinstance(layer.gate_up, BlockQuantLinear) and layer.gate is None
    assert [p.fmt for p in layer.gate_up.parts] == [int(Q.Q4_0)]
    assert isinstance(model.embed, BlockEmbedding) and isinstance(model.lm_head, BlockQuantLinear)
    fstate = gguf_float_state_dict(q4_gguf, cfg, torch.float32)
    want = gguf_state_dict(open_gguf(q4_gguf), cfg)  # gguf's own decoders, q/k rows unpermuted
    for name, t in want.items():
        if name in fstate:
            assert torch.equal(fstate[name], t), name
    reference = LlamaForCausalLM(cfg, dict(fstate), torch.float32, 256)
    _close_to_reference(_logits(model, IDS), _logits(reference, IDS))
