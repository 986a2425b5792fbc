"""The multi-query paged decode kernel (``paged_decode_mq``: several query rows per request,
causal among them, as in verifying a decode with its draft tokens) against a float64 reference,
and its input checks."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmtower.kernels.paged_attention import paged_decode, paged_decode_mq

EXAMPLES = int(os.environ.get("LLMTOWER_HYPOTHESIS_EXAMPLES", "40"))


def reference(q, k_cache, v_cache, tables, lens, q_lens, scale):
    """float64, one request and one query row at a time: row i of a request with context c and
    q_len rows sees keys 0 .. c - q_len + i; query head h reads KV head h // group."""
    bs, hkv, d = k_cache.shape[1:]
    heads = q.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for r, (c, nq) in enumerate(zip(lens, q_lens)):
        blocks = tables[r, :-(-c // bs)]
        k = k_cache[blocks].reshape(-1, hkv, d)[:c].double()
        v = v_cache[blocks].reshape(-1, hkv, d)[:c].double()
        for i in range(nq):
            seen = c - nq + i + 1
            for h in range(heads):
                kh = k[:seen, h // (heads // hkv)]
                w = torch.softmax((kh @ q[row + i, h].double()) * scale, dim=0)
                out[row + i, h] = w @ v[:seen, h // (heads // hkv)]
        row += nq
    return out


def case(seed, heads, kv_heads, head_dim, block_size, lens, q_lens, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g)  # scattered blocks, never shared
    tables = torch.zeros(len(lens), max(need) + 2, dtype=torch.int64)  # padded like the runner's
    used = 0
    for r, nb in enumerate(need):
        tables[r, :nb] = perm[used:used + nb]
        used += nb
    # q as the model hands it over: a view into a wider [T, heads + 2 * kv_heads, D] tensor
    qkv = torch.randn(sum(q_lens), heads + 2 * kv_heads, head_dim, generator=g)
    q = qkv.to(dtype)[:, :heads]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int64)
    return (q, k_cache.to(dtype), v_cache.to(dtype), tables,
            torch.tensor(lens, dtype=torch.int64), starts)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),    # SmolLM2
    (12, 12, 64, 16),  # W1
    (8, 2, 128, 8),    # GQA, the unrolled 128 copy
    (6, 3, 24, 1),     # generic head size, one token per block
    (14, 2, 48, 16),   # 7 heads per KV head, a head size of 16-wide slices but not 64/128
])
@pytest.mark.parametrize("threads", [1, 2])
def test_multi_query_rows_match_float64_reference(heads, kv_heads, head_dim, block_size, threads):
    lens = [1, 9, 17, block_size + 3, 120, 40, 2]
    q_lens = [1, 9, 16, 2, 9, 1, 2]
    q, kc, vc, tables, ctx, starts = case(0, heads, kv_heads, head_dim, block_size, lens, q_lens)
    out = torch.full(q.shape, float("nan"))
    scale = head_dim ** -0.5
    paged_decode_mq(q, kc, vc, tables, ctx, starts, out, scale, threads)
    expected = reference(q, kc, vc, tables, lens, q_lens, scale)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_one_row_per_request_equals_the_decode_kernel():
    lens = [5, 33, 70, 1]
    q, kc, vc, tables, ctx, starts = case(1, 9, 3, 64, 16, lens, [1] * len(lens))
    a = torch.empty(q.shape)
    b = torch.empty(q.shape)
    paged_decode_mq(q, kc, vc, tables, ctx, starts, a, 0.125, 2)
    paged_decode(q, kc, vc, tables, ctx, b, 0.125, 2)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (4, 2, 40)])
def test_bfloat16_is_float32_math_rounded_once(heads, kv_heads, head_dim):
    lens, q_lens = [20, 65, 9, 3], [5, 9, 9, 1]
    q, kc, vc, tables, ctx, starts = case(2, heads, kv_heads, head_dim, 16, lens, q_lens,
                                          torch.bfloat16)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    paged_decode_mq(q, kc, vc, tables, ctx, starts, out, scale, 2)
    expected = reference(q.float(), kc.float(), vc.float(), tables, lens, q_lens, scale)
    torch.testing.assert_close(out.float(), expected.float().bfloat16().float(), rtol=8e-3,
                               atol=1e-3)


def test_reads_only_its_own_blocks_and_rows():
    """Blocks not in a request's table and query rows of other requests are never read:
    poisoning them with NaN changes nothing."""
    lens, q_lens = [30, 18], [4, 3]
    q, kc, vc, tables, ctx, starts = case(4, 4, 2, 16, 8, lens, q_lens)
    scale = 0.25
    expected = reference(q, kc, vc, tables, lens, q_lens, scale)
    used = set(tables[0, :4].tolist()) | set(tables[1, :3].tolist())
    for b in range(kc.shape[0]):
        if b not in used:
            kc[b] = float("nan")
            vc[b] = float("nan")
    # the slots past each request's last position inside its last block
    kc[tables[0, 3], 30 % 8:] = float("nan")
    vc[tables[1, 2], 18 % 8:] = float("nan")
    out = torch.empty(q.shape)
    paged_decode_mq(q, kc, vc, tables, ctx, starts, out, scale, 2)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_errors_not_crashes():
    lens, q_lens = [10, 20], [3, 2]
    q, kc, vc, tables, ctx, starts = case(5, 4, 2, 16, 8, lens, q_lens)
    out = torch.empty(q.shape)

    def call(**kw):
        args = dict(q=q, k_cache=kc, v_cache=vc, block_tables=tables, context_lens=ctx,
                    query_start=starts, out=out, scale=0.25, num_threads=1)
        args.update(kw)
        return paged_decode_mq(**args)

    with pytest.raises(ValueError, match="query_start must run from 0"):
        call(query_start=torch.tensor([0, 3, 4]))  # rows past q's end would be written
    with pytest.raises(ValueError, match="query_start must run from 0"):
        call(query_start=torch.tensor([1, 3, 5]))
    with pytest.raises(ValueError, match="1..context_len query rows"):
        call(query_start=torch.tensor([0, 5, 5]))  # an empty request
    with pytest.raises(ValueError, match="1..context_len query rows"):
        call(context_lens=torch.tensor([2, 20]))  # 3 rows but only 2 positions
    with pytest.raises(ValueError, match="contiguous int64"):
        call(query_start=starts.int())
    with pytest.raises(ValueError, match="block ids"):
        bad = tables.clone()
        bad[1, 1] = kc.shape[0]
        call(block_tables=bad)
    with pytest.raises(ValueError, match="context lengths"):
        call(context_lens=torch.tensor([10, tables.shape[1] * 8 + 1]))
    with pytest.raises(ValueError, match="block_tables"):
        call(context_lens=torch.tensor([10, 20, 30]))
    with pytest.raises(ValueError, match="out is"):
        call(out=torch.empty(q.shape[0] + 1, 4, 16))
    with pytest.raises(TypeError, match="one dtype"):
        call(out=out.double())


@settings(max_examples=EXAMPLES, deadline=None)
@given(kv_heads=st.integers(1, 3), group=st.integers(1, 4), head_dim=st.sampled_from([8, 64, 20]),
       block_size=st.sampled_from([1, 4, 16]),
       reqs=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 17)), min_size=1, max_size=6),
       threads=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_random_shapes_match_float64_reference(kv_heads, group, head_dim, block_size, reqs,
                                               threads, seed):
    q_lens = [nq for _, nq in reqs]
    lens = [c + nq for c, nq in reqs]  # a context before the rows (maybe none), then the rows
    heads = kv_heads * group
    q, kc, vc, tables, ctx, starts = case(seed, heads, kv_heads, head_dim, block_size, lens,
                                          q_lens)
    out = torch.full(q.shape, float("nan"))
    scale = head_dim ** -0.5
    paged_decode_mq(q, kc, vc, tables, ctx, starts, out, scale, threads)
    expected = reference(q, kc, vc, tables, lens, q_lens, scale)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 64), (3, 64), (2, 24)])
def test_int8_cache_multi_query_rows_match_the_dequantized_reference(dtype, kv_heads, head_dim):
    """The int8 kernel with several rows per request equals float64 attention over the
    dequantized cache (the quantization error is the cache's, not the kernel's)."""
    from llmtower.kernels.kv_quant import dequantize, quantize
    from llmtower.kernels.paged_attention_int8 import paged_decode_int8

    lens, q_lens = [9, 40, 3, 25], [9, 4, 1, 16]
    q, kc, vc, tables, ctx, starts = case(6, 3 * kv_heads, kv_heads, head_dim, 8, lens, q_lens)
    cache = quantize(torch.stack([kc, vc]))
    k8, v8 = cache[0].contiguous(), cache[1].contiguous()
    q = q.to(dtype)
    out = torch.empty(q.shape, dtype=dtype)
    scale = head_dim ** -0.5
    paged_decode_int8(q, k8, v8, tables, ctx, out, scale, 2, query_start=starts)
    expected = reference(q.float(), dequantize(k8, torch.float32, head_dim),
                         dequantize(v8, torch.float32, head_dim), tables, lens, q_lens, scale)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="1..context_len query rows"):
        paged_decode_int8(q, k8, v8, tables, torch.tensor([9, 40, 3, 15]), out, scale, 1,
                          query_start=starts)


def test_bfloat16_cache_under_float32_model_multi_query():
    from llmtower.kernels.paged_attention_int8 import paged_decode_kv

    lens, q_lens = [12, 30], [5, 9]
    q, kc, vc, tables, ctx, starts = case(7, 4, 2, 16, 4, lens, q_lens)
    cache = torch.stack([kc, vc]).bfloat16()
    out = torch.empty(q.shape)
    paged_decode_kv(q, cache, tables, ctx, out, 0.25, query_start=starts)
    expected = reference(q.bfloat16().float(), cache[0].float(), cache[1].float(), tables, lens,
                         q_lens, 0.25)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)
