"""The float32 causal prefill-attention kernel (``prefill_attention_f32.c``) against a float64
reference (as close as PyTorch's SDPA gets), its input checks, and where the attention layer
uses it (float32 with the C backend)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtower.kernels import ops
from llmtower.kernels.prefill_attention_f32 import (prefill_attention_f32,
                                                    prefill_f32_shape_ok)
from llmtower.models.attention import AttentionMetadata, PagedAttention, PrefillSeq

needs_kernel = pytest.mark.skipif(ops.capabilities().why_not("prefill_f32") is not None,
                                  reason=f"kernel unavailable: {ops.capabilities().why_not('prefill_f32')}")


def qkv_views(n, heads, kv_heads, head_dim, seed=0, spread=1.0):
    """q, k, v as the model hands them over: strided row views into one fused [n, ...] tensor."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g) * spread
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


def sdpa(q, k, v, scale):
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64),     # SmolLM2: 3 query heads per KV head
    (4, 4, 16),     # no grouping, the smallest head size
    (8, 2, 128),    # 4 per KV head, two 64-dim passes of the value product
    (6, 1, 80),     # multi-query, a head size that ends in a 16-dim pass
])
@pytest.mark.parametrize("n", [1, 2, 7, 15, 16, 17, 31, 33, 144, 257])
def test_kernel_matches_float64_as_closely_as_sdpa(heads, kv_heads, head_dim, n):
    q, k, v = qkv_views(n, heads, kv_heads, head_dim, seed=n, spread=2.0)
    scale = head_dim ** -0.5
    out = torch.full((n, heads, head_dim), float("nan"))
    prefill_attention_f32(q, k, v, out, scale, 2)
    want = reference(q, k, v, scale)
    err = (out.double() - want).abs().max().item()
    sdpa_err = (sdpa(q, k, v, scale).double() - want).abs().max().item()
    assert err <= max(4 * sdpa_err, 2e-6), (err, sdpa_err)


@needs_kernel
def test_threads_do_not_change_results():
    q, k, v = qkv_views(300, 9, 3, 64, seed=1)
    one, two = torch.empty(300, 9, 64), torch.empty(300, 9, 64)
    prefill_attention_f32(q, k, v, one, 0.125, 1)
    prefill_attention_f32(q, k, v, two, 0.125, 2)
    assert torch.equal(one, two)
    # and a row's result does not depend on the rows after it (causal, same sums)
    part = torch.empty(100, 9, 64)
    prefill_attention_f32(q[:100], k[:100], v[:100], part, 0.125, 2)
    assert torch.equal(part, one[:100])


@needs_kernel
def test_bad_inputs_raise_clear_errors():
    q, k, v = qkv_views(8, 4, 2, 32)
    out = torch.empty(8, 4, 32)
    with pytest.raises(TypeError, match="runs float32"):
        prefill_attention_f32(q.bfloat16(), k, v, out, 0.1, 1)
    with pytest.raises(ValueError, match="do not fit"):
        prefill_attention_f32(q, k[:4], v[:4], out, 0.1, 1)
    with pytest.raises(ValueError, match="contiguous"):
        prefill_attention_f32(q, k, v, torch.empty(8, 32, 4).transpose(1, 2), 0.1, 1)
    q2, k2, v2 = qkv_views(8, 4, 4, 24)
    with pytest.raises(ValueError, match="multiple of 16"):
        prefill_attention_f32(q2, k2, v2, torch.empty(8, 4, 24), 0.1, 1)
    assert not prefill_f32_shape_ok(9, 4, 64) and prefill_f32_shape_ok(9, 3, 64)
    assert prefill_attention_f32(q[:0], k[:0], v[:0], out[:0], 0.1, 1).shape == (0, 4, 32)


def _layer(dtype, backend="auto", heads=9, kv_heads=3, head_dim=64):
    return PagedAttention(heads, kv_heads, head_dim, block_size=16, dtype=dtype,
                          gather_buffer_blocks=8, backend=backend)


def test_layer_uses_kernel_for_float32_with_c_backend_only():
    assert not _layer(torch.bfloat16).prefill_f32
    assert not _layer(torch.float32, "torch").prefill_f32
    assert not _layer(torch.float32, heads=4, kv_heads=4, head_dim=24).prefill_f32
    assert _layer(torch.float32).prefill_f32 == (ops.capabilities().why_not("prefill_f32") is None
                                                 and _layer(torch.float32).backend == "c")


@needs_kernel
def test_layer_forward_two_fresh_prefills_match_sdpa_path():
    """Two fresh prefills in one flat batch through PagedAttention.forward: the kernel's rows
    agree with the SDPA path's to float32 rounding, and each sequence sees only itself."""
    lens = [37, 20]
    n = sum(lens)
    q, k, v = qkv_views(n, 9, 3, 64, seed=3)
    cache = torch.zeros(2, 8, 16, 3, 64)
    meta = AttentionMetadata(n, torch.arange(n, dtype=torch.int64),
                             prefills=[PrefillSeq(0, 37, 0), PrefillSeq(37, 20, 0)])
    fast = _layer(torch.float32)
    if fast.backend != "c":
        pytest.skip("the C attention backend is unavailable here")
    slow = _layer(torch.float32)
    slow.prefill_f32 = False
    a = fast.forward(q, k, v, cache.clone(), meta)
    b = slow.forward(q, k, v, cache.clone(), meta)
    assert (a - b).abs().max().item() < 1e-5
    second = reference(q[37:], k[37:], v[37:], 0.125).reshape(20, -1)
    assert (a[37:].double() - second).abs().max().item() < 1e-5
