"""The int8 KV layout (--kv-cache-dtype): rows quantized with their own scale, swaps and block
moves carry the scales, and a bad dtype is a clear error."""
from __future__ import annotations

import pytest
import torch

from llmtower.engine.args import EngineArgs
from llmtower.executor.kv_cache import KVCache, bytes_per_block
from llmtower.kernels.kv_quant import dequantize, quantize, resolve_kv_cache_dtype, write_slots
from llmtower.models.config import ModelConfig


def _config(head_dim: int = 64, kv_heads: int = 2, layers: int = 2) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=head_dim * 4, intermediate_size=8,
                       num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=kv_heads)


def test_quantized_values_stay_within_half_a_step_of_their_group():
    torch.manual_seed(0)
    x = torch.randn(7, 3, 64) * torch.logspace(-3, 2, 7).view(7, 1, 1)  # rows of any magnitude
    x[:, :, 5] *= 100  # an outlier channel: it coarsens its own group of 32 only
    packed = quantize(x)
    assert packed.dtype == torch.int8 and packed.shape == (7, 3, 72)  # 64 values, 2 scales
    step = x.view(7, 3, 2, 32).abs().amax(-1, keepdim=True).expand(7, 3, 2, 32).reshape(7, 3, 64) / 127
    err = (dequantize(packed, torch.float32, 64) - x).abs()
    assert (err <= step / 2 + 1e-6 * step).all()
    assert (err[..., 32:] <= x[..., 32:].abs().amax(-1, keepdim=True) / 254 * 1.0001).all()
    assert dequantize(quantize(torch.zeros(2, 64)), torch.float32, 64).eq(0).all()
    # A head_dim that is no multiple of 32: one scale per row.
    odd = quantize(torch.randn(4, 24))
    assert odd.shape == (4, 28)


def test_swap_and_moves_carry_the_scales():
    cfg = _config()
    kv = KVCache(cfg, num_blocks=6, num_cpu_blocks=4, block_size=4, dtype=torch.float32,
                 kv_dtype=torch.int8)
    assert kv.kv_caches[0].shape == (2, 6, 4, 2, 72)
    x = torch.randn(8, 2, 64) * 5
    slots = torch.arange(8, 16)  # blocks 2 and 3
    for c in kv.kv_caches:
        write_slots(c[0], slots, x)
        write_slots(c[1], slots, -x)
    want = dequantize(kv.kv_caches[1][0, 2:4].reshape(8, 2, 72), torch.float32, 64)
    kv.swap_out([(2, 0), (3, 1)])
    for c in kv.kv_caches:
        c.zero_()
    kv.swap_in([(0, 4), (1, 5)])
    kv.move([(4, 0), (5, 1)])
    for c in kv.kv_caches:
        assert torch.equal(dequantize(c[0, 0:2].reshape(8, 2, 72), torch.float32, 64), want)
        assert torch.equal(dequantize(c[1, 0:2].reshape(8, 2, 72), torch.float32, 64), -want)
    assert (want - x).abs().max() <= x.abs().max() / 254 + 1e-6


def test_block_memory_counts_the_element_size_and_the_scales():
    cfg = _config(head_dim=64)
    f32 = bytes_per_block(cfg, 16, torch.float32)
    assert bytes_per_block(cfg, 16, torch.bfloat16) * 2 == f32
    assert bytes_per_block(cfg, 16, torch.int8) * 256 == f32 * 72  # 64 values + 2 scales
    kv = KVCache(cfg, 3, 0, 16, torch.float32, kv_dtype=torch.int8)
    assert sum(c.nbytes for c in kv.kv_caches) == 3 * bytes_per_block(cfg, 16, torch.int8)


def test_a_kv_cache_dtype_that_does_not_exist_is_a_clear_error():
    with pytest.raises(ValueError, match=r"--kv-cache-dtype must be one of 'auto', 'bfloat16', 'int8'"):
        EngineArgs(model="x", kv_cache_dtype="float8")
    with pytest.raises(ValueError, match="kv_cache_dtype='float8' is not supported"):
        resolve_kv_cache_dtype("float8", torch.float32)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
