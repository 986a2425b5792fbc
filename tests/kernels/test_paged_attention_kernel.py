"""The C paged decode-attention kernel against PyTorch's SDPA, its input checks, and its build."""
from __future__ import annotations

import ctypes
import os
import shutil
import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from llmtower.kernels import build, ops
from llmtower.kernels.paged_attention import paged_decode
from llmtower.models.attention import resolve_backend
from llmtower.utils import cpu_info


def reference(q, k_cache, v_cache, tables, lens, scale):
    """Each request alone: gather its blocks, cut to its length, SDPA with GQA."""
    bs, hkv, d = k_cache.shape[1:]
    outs = []
    for r in range(q.shape[0]):
        n = int(lens[r])
        blocks = tables[r, :-(-n // bs)]
        k = k_cache[blocks].reshape(-1, hkv, d)[:n].transpose(0, 1)
        v = v_cache[blocks].reshape(-1, hkv, d)[:n].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[r].unsqueeze(1), k, v, scale=scale,
                                           enable_gqa=q.shape[1] != hkv)
        outs.append(o.squeeze(1))
    return torch.stack(outs)


def case(seed, heads, kv_heads, head_dim, block_size, lens, num_blocks=200):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    width = max(-(-n // block_size) for n in lens) + 2  # padded like the runner's tables
    perm = torch.randperm(num_blocks, generator=g)  # scattered, never shared
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    used = 0
    for r, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[r, :nb] = perm[used:used + nb]
        used += nb
    # q as the model hands it over: a view into a wider [T, heads + kv_heads, D] tensor
    qk = torch.randn(len(lens), heads + kv_heads, head_dim, generator=g)
    return qk[:, :heads], k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (12, 12, 64, 16),  # W1's shape
    (8, 2, 32, 4),     # grouped-query attention
    (9, 3, 64, 16),    # SmolLM2's shape
    (4, 1, 8, 1),      # one token per block
    (14, 2, 48, 16),   # 7 heads per KV head (values weighed 4 + 3 heads at a time), D not 64/128
    (16, 2, 128, 32),  # 8 heads per KV head
])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_sdpa(heads, kv_heads, head_dim, block_size, threads):
    lens = [1, 2, block_size, block_size + 1, 3 * block_size - 1, 97, 200, 5]
    q, k_cache, v_cache, tables, ctx = case(0, heads, kv_heads, head_dim, block_size, lens,
                                            num_blocks=sum(-(-n // block_size) for n in lens) + 8)
    out = torch.full((len(lens), heads, head_dim), float("nan"))
    scale = head_dim ** -0.5
    paged_decode(q, k_cache, v_cache, tables, ctx, out, scale, threads)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, ctx, scale),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 12, 64), (9, 3, 64), (8, 2, 24)])
def test_bfloat16_kernel_is_float32_math_rounded_once(heads, kv_heads, head_dim):
    """bfloat16 in and out, float32 inside: equal to float32 attention over the same bfloat16
    values, rounded to bfloat16 at the end (one rounding step apart at most)."""
    lens = [1, 17, 64, 130, 33]
    q, k_cache, v_cache, tables, ctx = case(3, heads, kv_heads, head_dim, 16, lens, num_blocks=40)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    out = torch.empty(len(lens), heads, head_dim, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    paged_decode(q, k_cache, v_cache, tables, ctx, out, scale, 2)
    expected = reference(q.float(), k_cache.float(), v_cache.float(), tables, ctx, scale)
    torch.testing.assert_close(out.float(), expected.bfloat16().float(), rtol=8e-3, atol=1e-3)
    # and as close to it as PyTorch's own bfloat16 SDPA gets
    ours = (out.float() - expected).abs().max()
    theirs = (reference(q, k_cache, v_cache, tables, ctx, scale).float() - expected).abs().max()
    assert ours <= theirs * 1.5


def test_kernel_reads_only_the_blocks_in_the_table():
    """Poison every block no request owns: a read outside the table would show as NaN."""
    lens = [7, 16, 33]
    q, k_cache, v_cache, tables, ctx = case(1, 4, 2, 16, 4, lens, num_blocks=40)
    owned = torch.zeros(40, dtype=torch.bool)
    for r, n in enumerate(lens):
        owned[tables[r, :-(-n // 4)]] = True
    expected = reference(q, k_cache, v_cache, tables, ctx, 0.25)
    k_cache[~owned] = float("nan")
    v_cache[~owned] = float("nan")
    # and the unused tail of each request's last block
    for r, n in enumerate(lens):
        if n % 4:
            last = tables[r, n // 4]
            k_cache[last, n % 4:] = float("nan")
            v_cache[last, n % 4:] = float("nan")
    out = torch.empty(3, 4, 16)
    paged_decode(q, k_cache, v_cache, tables, ctx, out, 0.25, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_errors_not_crashes():
    q, k_cache, v_cache, tables, ctx = case(2, 4, 2, 8, 4, [5, 9], num_blocks=8)
    out = torch.empty(2, 4, 8)
    bad_tables = tables.clone()
    bad_tables[1, 0] = 8  # past the cache
    with pytest.raises(ValueError, match="block ids"):
        paged_decode(q, k_cache, v_cache, bad_tables, ctx, out, 1.0, 1)
    with pytest.raises(ValueError, match="context lengths"):
        paged_decode(q, k_cache, v_cache, tables, torch.tensor([5, 0]), out, 1.0, 1)
    with pytest.raises(ValueError, match="context lengths"):  # more keys than the table holds
        paged_decode(q, k_cache, v_cache, tables, torch.tensor([5, 4 * tables.shape[1] + 1]),
                     out, 1.0, 1)
    with pytest.raises(TypeError, match="one dtype"):
        paged_decode(q.bfloat16(), k_cache, v_cache, tables, ctx, out, 1.0, 1)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        paged_decode(q.half(), k_cache, v_cache, tables, ctx, out, 1.0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode(q, k_cache, v_cache, tables, ctx, torch.empty(4, 8, 2).transpose(0, 2), 1.0, 1)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode(torch.empty(2, 3, 8), k_cache, v_cache, tables, ctx, out, 1.0, 1)


def test_every_kernel_is_in_one_library():
    lib = build.library()
    assert ops.capabilities().library == lib._name
    for entry in ("paged_decode", "paged_decode_mq", "paged_decode_int8", "prefill_attention",
                  "prefill_attention_f32", "gemv_bf16", "gemm_bf16", "gemm_f32", "decode_step",
                  "greedy_head_tokens", "add_rms_norm", "llmtower_bind_threads",
                  "kernel_vector_exp_check"):
        assert hasattr(lib, entry), entry


def test_build_is_cached_and_a_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # two of the sources, to keep the test short: the objects are linked all the same
    monkeypatch.setattr(build, "sources", lambda: [build.HERE / "lib_init.c",
                                                   build.HERE / "cpu_bind.c"])
    first = build.library.__wrapped__()
    libs = list((tmp_path / "llmtower" / "kernels").glob("*.so"))
    assert len(libs) == 1 and first._name == str(libs[0])
    assert hasattr(first, "kernel_isa") and hasattr(first, "llmtower_bind_threads")
    mtime = libs[0].stat().st_mtime_ns
    build.library.__wrapped__()  # reuses the file, no rebuild
    assert libs[0].stat().st_mtime_ns == mtime
    assert not [p for p in libs[0].parent.iterdir() if p.name.startswith(".")]  # no temp files

    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(build.KernelUnavailable, match="no-such-compiler"):
        build.library.__wrapped__()


def test_a_failed_build_turns_every_kernel_off_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(ops, "library", build.library.__wrapped__)
    caps = ops.probe()
    assert caps.library is None and not caps.build_isa
    for kernel in ops.KERNELS:
        assert not caps.can_run(kernel)
        assert "no-such-compiler" in (caps.why_not(kernel) or "")
    assert "paged_attention: off (no C compiler" in "\n".join(caps.describe())


def test_a_build_without_march_native_still_links_one_library(tmp_path, monkeypatch):
    """Where -march=native fails (a compiler that does not know it), the build retries with the
    plain flags: portable code, the objects linked into one library (two sources here, to keep
    the test short)."""
    monkeypatch.setattr(build, "NATIVE", ["-march=no-such-cpu"])
    monkeypatch.setattr(build, "sources", lambda: [build.HERE / "lib_init.c",
                                                   build.HERE / "paged_attention_mq.c"])
    path = build.build(tmp_path)
    lib = ctypes.CDLL(str(path))
    lib.kernel_isa.restype = ctypes.c_char_p
    assert b"avx512f" not in lib.kernel_isa()  # no AVX-512 without -march
    assert hasattr(lib, "paged_decode_mq") and hasattr(lib, "kernel_vector_exp_check")


def test_a_compiler_wrapper_gets_its_own_library(tmp_path, monkeypatch):
    """An AVX2 host emulated by a CC wrapper that rewrites -march=native to x86-64-v3 (and
    prints the real compiler's --version) must not load the native library cached before it."""
    if "avx512f" not in cpu_info().flags:
        pytest.skip("the native build here has no AVX-512 to tell apart")
    monkeypatch.setattr(build, "sources", lambda: [build.HERE / "lib_init.c",
                                                   build.HERE / "cpu_bind.c"])
    monkeypatch.delenv(build.ISA_ENV, raising=False)
    cc = shutil.which(os.environ.get("CC") or "cc")
    wrapper = tmp_path / "cc-v3"
    wrapper.write_text(f'#!/bin/sh\nfor a; do shift; [ "$a" = -march=native ] && '
                       f'a=-march=x86-64-v3; set -- "$@" "$a"; done\nexec {cc} "$@"\n')
    wrapper.chmod(0o755)
    native = build.build(tmp_path / "cache")
    monkeypatch.setenv("CC", str(wrapper))
    emulated = build.build(tmp_path / "cache")
    assert emulated != native
    isa = []
    for path in (native, emulated):
        lib = ctypes.CDLL(str(path))
        lib.kernel_isa.restype = ctypes.c_char_p
        isa.append(lib.kernel_isa())
    assert b"avx512f" in isa[0] and b"avx512f" not in isa[1] and b"avx2" in isa[1]


def test_capabilities_name_each_kernel_and_take_paths_off_by_copy():
    caps = ops.capabilities()
    with pytest.raises(KeyError, match="no kernel"):
        caps.why_not("no_such_kernel")
    off = caps.without("gemm_f32", "benchmark: off")
    assert off.why_not("gemm_f32") == "benchmark: off" and off is not caps
    assert caps.why_not_in("prefill", torch.float16) == \
        "the prefill kernel runs float32 and bfloat16, not torch.float16"
    assert set(caps.cpu_isa) <= set(ops.ISA_FLAGS)


def test_backend_choice(monkeypatch, caplog):
    assert resolve_backend("torch", torch.float32) == "torch"
    assert resolve_backend("auto", torch.float16) == "torch"
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        resolve_backend("c", torch.float16)
    with pytest.raises(ValueError, match="not one of"):
        resolve_backend("cuda", torch.float32)
    assert resolve_backend("auto", torch.float32) == "c"  # gcc is on every test machine
    assert resolve_backend("auto", torch.bfloat16) == "c"

    off = ops.capabilities().without("paged_attention", "no C compiler: 'cc' is not on PATH")
    monkeypatch.setattr(ops, "capabilities", lambda: off)
    with caplog.at_level(logging.WARNING):
        assert resolve_backend("auto", torch.float32) == "torch"
    assert "no C compiler" in caplog.text
    with pytest.raises(RuntimeError, match="no C compiler"):
        resolve_backend("c", torch.float32)


@settings(max_examples=60, deadline=None)
@given(kv_heads=st.integers(1, 4), group=st.integers(1, 4), head_dim=st.sampled_from([4, 16, 64, 128]),
       block_size=st.sampled_from([1, 2, 8, 16, 32]), lens=st.lists(st.integers(1, 90), min_size=1, max_size=9),
       threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_kernel_matches_sdpa_on_random_shapes(kv_heads, group, head_dim, block_size, lens, threads, seed):
    heads = kv_heads * group
    q, k_cache, v_cache, tables, ctx = case(seed, heads, kv_heads, head_dim, block_size, lens,
                                            num_blocks=sum(-(-n // block_size) for n in lens) + 3)
    out = torch.empty(len(lens), heads, head_dim)
    paged_decode(q, k_cache, v_cache, tables, ctx, out, head_dim ** -0.5, threads)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, ctx, head_dim ** -0.5),
                               rtol=1e-5, atol=1e-5)


def _bf16_close(out, q, k_cache, v_cache, tables, ctx, scale):
    """bfloat16 output within the error of PyTorch's own bfloat16 SDPA of the float32 truth."""
    expected = reference(q.float(), k_cache.float(), v_cache.float(), tables, ctx, scale)
    torch.testing.assert_close(out.float(), expected.bfloat16().float(), rtol=8e-3, atol=2e-3)
    ours = (out.float() - expected).abs().max()
    theirs = (reference(q, k_cache, v_cache, tables, ctx, scale).float() - expected).abs().max()
    assert ours <= theirs * 1.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (14, 2, 48),   # grouped path, D a multiple of 16 but not of 32 (bfloat16 widens the keys)
    (16, 2, 128),  # grouped path, vdpbf16ps over 4 pairs of 32 dims
    (4, 1, 256),   # the largest head the grouped path takes
    (14, 2, 96),   # AVX2 / NEON vector path: 7 heads per KV head weighed 3 + 3 + 1, 3 x 32 dims
    (4, 2, 272),   # larger: the per-request path
])
def test_grouped_decode_head_sizes(dtype, heads, kv_heads, head_dim):
    lens = [1, 15, 16, 17, 31, 33, 130, 64]
    q, k_cache, v_cache, tables, ctx = case(5, heads, kv_heads, head_dim, 16, lens, num_blocks=40)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    out = torch.full((len(lens), heads, head_dim), float("nan"), dtype=dtype)
    scale = head_dim ** -0.5
    paged_decode(q, k_cache, v_cache, tables, ctx, out, scale, 3)
    if dtype == torch.float32:
        torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, ctx, scale),
                                   rtol=1e-5, atol=1e-5)
    else:
        _bf16_close(out, q, k_cache, v_cache, tables, ctx, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_over_a_huge_score_range(dtype):
    """Scores hundreds apart: most weights underflow (the vectorised exp clamps below -87.3)
    and the maximum may sit in any lane of a 16-key tile or in a short tail."""
    lens = [1, 3, 16, 19, 47, 100]
    q, k_cache, v_cache, tables, ctx = case(6, 9, 3, 64, 16, lens, num_blocks=30)
    q = (q * 40).to(dtype)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    out = torch.empty(len(lens), 9, 64, dtype=dtype)
    paged_decode(q, k_cache, v_cache, tables, ctx, out, 0.125, 2)
    expected = reference(q.float(), k_cache.float(), v_cache.float(), tables, ctx, 0.125)
    assert torch.isfinite(out.float()).all()
    if dtype == torch.float32:
        # Scores of ~400 carry ~2.4e-5 of rounding (half an ulp times the dot product's terms)
        # into every weight's exp, whatever the order: 1e-4. A wrong maximum or underflow is O(1)
        # off. (The portable path built for x86-64-v2 lands 6.5e-5 off where AVX-512's did not.)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(out.float(), expected.bfloat16().float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_does_not_depend_on_the_thread_count(dtype):
    """Threads claim (request, KV head) units as they go and fetch their next unit ahead; every
    output row is still computed by one thread in one order, so any thread count gives the
    same bits."""
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(1, 300, (40,), generator=g).tolist()
    q, k_cache, v_cache, tables, ctx = case(7, 9, 3, 64, 16, lens,
                                            num_blocks=sum(-(-n // 16) for n in lens) + 4)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    outs = []
    for threads in (1, 2, 3):
        out = torch.empty(len(lens), 9, 64, dtype=dtype)
        paged_decode(q, k_cache, v_cache, tables, ctx, out, 0.125, threads)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    if dtype == torch.bfloat16:
        _bf16_close(outs[0], q, k_cache, v_cache, tables, ctx, 0.125)


def test_bfloat16_grouped_decode_reads_only_the_blocks_in_the_table():
    """The bfloat16 grouped path (pairs of dims per vdpbf16ps, whole 16-key tiles) with every
    unowned block and every slot past a context poisoned: a stray read shows as NaN."""
    lens = [5, 16, 33, 40]
    q, k_cache, v_cache, tables, ctx = case(8, 9, 3, 64, 16, lens, num_blocks=20)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    expected = torch.empty(len(lens), 9, 64, dtype=torch.bfloat16)
    paged_decode(q, k_cache, v_cache, tables, ctx, expected, 0.125, 2)
    owned = torch.zeros(20, dtype=torch.bool)
    for r, n in enumerate(lens):
        owned[tables[r, :-(-n // 16)]] = True
        if n % 16:
            k_cache[tables[r, n // 16], n % 16:] = float("nan")
            v_cache[tables[r, n // 16], n % 16:] = float("nan")
    k_cache[~owned] = float("nan")
    v_cache[~owned] = float("nan")
    out = torch.empty_like(expected)
    paged_decode(q, k_cache, v_cache, tables, ctx, out, 0.125, 2)
    assert torch.equal(out, expected)
