"""The int8 decode-attention kernel (paged_attention_int8.c) equals attention over the
dequantized cache, for float32 and bfloat16 queries, under GQA, through scattered blocks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtower.kernels.kv_quant import dequantize, quantize
from llmtower.kernels.paged_attention_int8 import paged_decode_int8, paged_decode_kv


def _reference(q, k, v, tables, lens, bs, scale):
    """SDPA per request over the float cache k/v [blocks, bs, Hkv, D]."""
    n, h, d = q.shape
    hkv = k.shape[2]
    out = torch.empty(n, h, d)
    for r in range(n):
        ln = int(lens[r])
        blocks = tables[r, :-(-ln // bs)]
        keys = k[blocks].reshape(-1, hkv, d)[:ln].transpose(0, 1)
        vals = v[blocks].reshape(-1, hkv, d)[:ln].transpose(0, 1)
        qq = q[r].float().view(hkv, h // hkv, d)
        out[r] = F.scaled_dot_product_attention(qq, keys, vals, scale=scale).reshape(h, d)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,d", [(1, 64), (2, 32), (4, 24)])  # 2 groups, 1, no multiple of 32
def test_int8_kernel_matches_attention_over_the_dequantized_cache(dtype, hkv, d):
    torch.manual_seed(hkv)
    nb, bs, h = 20, 4, 4
    x = torch.randn(2, nb, bs, hkv, d) * 3
    x[..., 1] *= 50  # an outlier channel (as in SmolLM2's keys)
    cache = quantize(x)
    lens = torch.tensor([1, 5, 17, 33], dtype=torch.int64)
    tables = torch.stack([torch.randperm(nb)[:9] for _ in lens]).contiguous()
    q = torch.randn(len(lens), h, d).to(dtype)
    out = torch.empty(len(lens), h, d, dtype=dtype)
    paged_decode_int8(q, cache[0].contiguous(), cache[1].contiguous(), tables, lens, out,
                      d ** -0.5, 2)
    want = _reference(q, dequantize(cache[0], torch.float32, d),
                      dequantize(cache[1], torch.float32, d),
                      tables, lens, bs, d ** -0.5)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # float32: summation order only
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def test_a_bfloat16_cache_under_a_float32_model_reads_in_place():
    torch.manual_seed(0)
    nb, bs, hkv, h, d = 8, 4, 2, 4, 16
    cache = torch.randn(2, nb, bs, hkv, d).to(torch.bfloat16)
    lens = torch.tensor([3, 14], dtype=torch.int64)
    tables = torch.tensor([[5, 1, 0, 7], [2, 6, 3, 4]], dtype=torch.int64)
    q = torch.randn(2, h, d)
    out = torch.empty(2, h, d)
    paged_decode_kv(q, cache, tables, lens, out, d ** -0.5)
    want = _reference(q.bfloat16(), cache[0].float(), cache[1].float(), tables, lens, bs,
                      d ** -0.5)
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)


def test_int8_kernel_refuses_a_float_cache():
    q = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="does not fit the int8 cache"):
        paged_decode_int8(q, torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8),
                          torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64),
                          torch.empty(1, 2, 8), 1.0, 1)
