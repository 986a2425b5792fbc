"""The slotted swap space: blocks swapped out as they are come back bit for bit, blocks
swapped out compressed come back within the int8 error bound, both kinds share one swap space
and scattered slots, and bad slot lists are refused."""
from __future__ import annotations

import pytest
import torch

from llmtower.core.swap_layout import PLAIN, SwapLayout, plan_swap_layout
from llmtower.executor.kv_cache import KVCache
from llmtower.kernels.kv_quant import dequantize, quantize
from llmtower.executor.swap_space import swap_layout_for, swap_slot_bytes
from llmtower.models.config import ModelConfig


def _config(head_dim: int = 64, kv_heads: int = 2, layers: int = 2) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=head_dim * 4,
                       intermediate_size=8, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=kv_heads)


def test_layout_at_float32_and_bfloat16_head_dim_64():
    # one (token, head) row: float32 256 B, bfloat16 128 B, int8 64 + 2 scales = 72 B
    f32 = plan_swap_layout(256 * 32, 72 * 32)
    assert f32 == SwapLayout(7, 2)  # 7 slots a block, 2 compressed: 3.5x
    assert f32.slot_bytes(256 * 32, 72 * 32) * 2 / (72 * 32) < 1.03  # padding included
    bf16 = plan_swap_layout(128 * 32, 72 * 32)
    assert bf16.slots_per_block / bf16.slots_per_compressed_block >= 1.7
    assert plan_swap_layout(72 * 32, 72 * 32) == PLAIN  # an int8 cache: nothing to gain
    cfg = _config()
    assert swap_layout_for(cfg, 16, torch.float32, may_compress=False) == PLAIN
    assert swap_layout_for(cfg, 16, torch.float32, may_compress=True) == SwapLayout(7, 2)
    assert swap_layout_for(cfg, 16, torch.int8, may_compress=True) == PLAIN
    plain = swap_slot_bytes(cfg, 16, torch.float32, PLAIN)
    assert plain == 2 * 2 * 16 * 2 * 64 * 4  # layers * K/V * tokens * heads * dims * bytes
    assert swap_slot_bytes(cfg, 16, torch.float32, SwapLayout(7, 2)) * 7 == pytest.approx(plain, rel=0.01)


def _filled(dtype: torch.dtype, num_slots: int, layout: SwapLayout) -> KVCache:
    kv = KVCache(_config(), num_blocks=8, num_cpu_blocks=num_slots, block_size=4,
                 dtype=dtype, swap_layout=layout)
    torch.manual_seed(0)
    for c in kv.kv_caches:
        c.copy_((torch.randn(c.shape) * 3).to(dtype))
        c[0, :, :, :, 5] *= 40  # an outlier channel in the keys
    return kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uncompressed_blocks_come_back_exactly_from_scattered_slots(dtype):
    kv = _filled(dtype, 40, SwapLayout(7, 2))
    want = [c[:, [1, 3]].clone() for c in kv.kv_caches]
    slots = [30, 2, 17, 5, 9, 11, 0, 39, 1, 22, 8, 13, 6, 4]  # 7 per block, anywhere
    kv.swap_out([(1, s) for s in slots[:7]] + [(3, s) for s in slots[7:]])
    for c in kv.kv_caches:
        c.zero_()
    kv.swap_in([(s, 6) for s in slots[:7]] + [(s, 2) for s in slots[7:]])
    for c, w in zip(kv.kv_caches, want):
        assert torch.equal(c[:, [6, 2]], w)
        assert c[:, [0, 1, 3]].eq(0).all()  # nothing else written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed_blocks_come_back_within_the_int8_bound(dtype):
    kv = _filled(dtype, 40, SwapLayout(7, 2))
    want = [c[:, [4, 5]].clone() for c in kv.kv_caches]
    # Block 4 compressed, block 5 not, in one swap-out: one swap space holds both kinds.
    kv.swap_out([(4, 10), (4, 3)] + [(5, s) for s in range(20, 27)], compressed=[4])
    for c in kv.kv_caches:
        c.zero_()
    kv.swap_in([(10, 0), (3, 0)] + [(s, 1) for s in range(20, 27)], compressed=[0])
    for c, w in zip(kv.kv_caches, want):
        assert torch.equal(c[:, 1], w[:, 1])  # the uncompressed one: exact
        back, orig = c[:, 0].float(), w[:, 0].float()
        assert not torch.equal(back, orig)  # really int8 on the way
        expect = dequantize(quantize(w[:, 0]), dtype, 64).float()
        assert torch.equal(back, expect)  # exactly what the int8 KV cache would hold
        bound = orig.abs().reshape(*orig.shape[:-1], 2, 32).amax(-1) / 254 + 1e-6
        err = (back - orig).abs().reshape(*orig.shape[:-1], 2, 32).amax(-1)
        tol = 0.0 if dtype == torch.float32 else orig.abs().max().item() / 128  # bf16 rounding
        assert (err <= bound + tol).all()


def test_bad_slot_lists_and_compression_without_slots_are_refused():
    kv = _filled(torch.float32, 40, SwapLayout(7, 2))
    with pytest.raises(ValueError, match="7 consecutive slot"):
        kv.swap_out([(1, 0), (1, 1)])  # a block needs 7 slots uncompressed
    with pytest.raises(ValueError, match="2 consecutive slot"):
        kv.swap_out([(1, 0), (2, 1), (1, 2), (2, 3)], compressed=[1, 2])  # interleaved
    plain = _filled(torch.float32, 4, PLAIN)
    with pytest.raises(RuntimeError, match="plain layout"):
        plain.swap_out([(1, 0)], compressed=[1])
    assert plain.swap_space is None and len(plain.swap_caches) == 2
