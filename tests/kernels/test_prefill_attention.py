"""The bfloat16 causal prefill-attention kernel (``prefill_attention.c``) against a float64
reference and against PyTorch's SDPA, its input checks, and where the attention layer uses it
(bfloat16 with the C backend) and where it keeps SDPA (float32, the torch backend)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtower.kernels import ops
from llmtower.kernels.prefill_attention import (prefill_attention,
                                                prefill_shape_ok)
from llmtower.models.attention import AttentionMetadata, PagedAttention, PrefillSeq

needs_kernel = pytest.mark.skipif(ops.capabilities().why_not("prefill_bf16") is not None,
                                  reason=f"kernel unavailable: {ops.capabilities().why_not('prefill_bf16')}")


def qkv_views(n, heads, kv_heads, head_dim, seed=0):
    """q, k, v as the model hands them over: strided row views into one fused [n, ...] tensor."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g).to(torch.bfloat16)
    q = qkv[:, :heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(n, kv_heads, head_dim)
    return q, k, v


def reference(q, k, v, scale):
    """float64 causal attention, query head h on KV head h // group."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.double().transpose(0, 1) for x in (q, k, v))
    kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
    s = (qd @ kd.transpose(1, 2)) * scale
    n = q.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ vd).transpose(0, 1)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64),     # SmolLM2: 3 query heads per KV head
    (4, 4, 32),     # no grouping, the smallest head size
    (8, 2, 128),    # 4 per KV head, two 64-dim passes of the value product
    (6, 1, 96),     # multi-query, a head size that ends in a 32-dim pass
])
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 33, 144, 257])
def test_kernel_matches_reference(heads, kv_heads, head_dim, n):
    """Odd lengths cross the 16-key tiles, the 32-key passes and the 16-row query blocks."""
    q, k, v = qkv_views(n, heads, kv_heads, head_dim, seed=n)
    scale = head_dim ** -0.5
    out = torch.full((n, heads, head_dim), float("nan"), dtype=torch.bfloat16)
    prefill_attention(q, k, v, out, scale, 2)
    want = reference(q, k, v, scale)
    err = (out.double() - want).abs().max().item()
    # bfloat16's own rounding of the output (8 bits) and of the weights: what SDPA shows too
    sdpa = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=heads != kv_heads)
    sdpa_err = (sdpa[0].transpose(0, 1).double() - want).abs().max().item()
    assert err <= max(2 * sdpa_err, 1e-2), (err, sdpa_err)
    # row 0 sees only key 0: its output is v[0] exactly (weight 1)
    group = heads // kv_heads
    assert torch.equal(out[0], v[0].repeat_interleave(group, 0))


@needs_kernel
def test_threads_do_not_change_results():
    q, k, v = qkv_views(200, 9, 3, 64)
    a = torch.empty(200, 9, 64, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    prefill_attention(q, k, v, a, 0.125, 1)
    prefill_attention(q, k, v, b, 0.125, 3)
    assert torch.equal(a, b)


@needs_kernel
def test_bad_inputs_raise_clear_errors():
    q, k, v = qkv_views(8, 9, 3, 64)
    out = torch.empty(8, 9, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        prefill_attention(q.float(), k, v, out, 0.125, 1)
    with pytest.raises(ValueError, match="do not fit"):
        prefill_attention(q, k[:7], v[:7], out, 0.125, 1)
    with pytest.raises(ValueError, match="contiguous"):
        prefill_attention(q.transpose(1, 2), k, v, out, 0.125, 1)
    q2, k2, v2 = qkv_views(8, 4, 4, 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        prefill_attention(q2, k2, v2, torch.empty(8, 4, 48, dtype=torch.bfloat16), 0.1, 1)
    assert not prefill_shape_ok(9, 4, 64) and prefill_shape_ok(9, 3, 64)


def _layer(dtype, backend="auto", heads=9, kv_heads=3, head_dim=64):
    return PagedAttention(heads, kv_heads, head_dim, block_size=16, dtype=dtype,
                          gather_buffer_blocks=8, backend=backend)


def test_layer_uses_kernel_only_for_bfloat16_with_c_backend():
    """float32 takes its own kernel (test_prefill_attention_f32.py); the torch backend SDPA."""
    assert not _layer(torch.float32).prefill_kernel
    assert not _layer(torch.bfloat16, "torch").prefill_kernel
    assert not _layer(torch.bfloat16, heads=4, kv_heads=4, head_dim=48).prefill_kernel
    assert _layer(torch.bfloat16).prefill_kernel == (ops.capabilities().why_not("prefill_bf16") is None
                                                     and _layer(torch.bfloat16).backend == "c")


@needs_kernel
def test_layer_forward_two_fresh_prefills_match_sdpa_path():
    """Two fresh prefills in one flat batch through PagedAttention.forward: the kernel's rows
    agree with the SDPA path's within bfloat16 rounding, and each sequence sees only itself."""
    lens = [37, 20]
    n = sum(lens)
    q, k, v = qkv_views(n, 9, 3, 64, seed=3)
    cache = torch.zeros(2, 8, 16, 3, 64, dtype=torch.bfloat16)
    meta = AttentionMetadata(n, torch.arange(n, dtype=torch.int64),
                             prefills=[PrefillSeq(0, 37, 0), PrefillSeq(37, 20, 0)])
    fast = _layer(torch.bfloat16)
    if fast.backend != "c":
        pytest.skip("the C attention backend is unavailable here")
    slow = _layer(torch.bfloat16)
    slow.prefill_kernel = False
    a = fast.forward(q, k, v, cache.clone(), meta)
    b = slow.forward(q, k, v, cache.clone(), meta)
    assert (a.float() - b.float()).abs().max().item() < 3e-2
    second = reference(q[37:], k[37:], v[37:], 0.125).reshape(20, -1)
    assert (a[37:].double() - second).abs().max().item() < 3e-2
