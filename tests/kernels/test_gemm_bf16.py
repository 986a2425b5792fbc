"""The bfloat16 decode-step GEMM kernel (kernels/gemm_bf16.c): on the few-row kernel's packed
weights it gives every row bit for bit the few-row kernel's result (gemv_bf16, itself checked
against float32 in test_gemv_bf16.py), at any row count, thread count and row stride, on both
paths (AVX512_BF16 where this CPU has it, and the portable C code). Its use in the model:
tests/models/test_linear.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtower.kernels import ops
from llmtower.kernels.build import KernelUnavailable
from llmtower.kernels.gemm_bf16 import gemm_bf16, gemm_bf16_silu_mul
from llmtower.kernels.gemv_bf16 import GemvWeight

try:
    from llmtower.kernels.gemm_bf16 import _lib
    _lib()
    BUILT = True
except KernelUnavailable:
    BUILT = False
needs_build = pytest.mark.skipif(not BUILT, reason="no C compiler")
needs_fast = pytest.mark.skipif(ops.capabilities().why_not("gemm_bf16") is not None, reason="no AVX512_BF16 here")
PATHS = [0, 1] if ops.capabilities().why_not("gemm_bf16") is None else [1]


def _by_fours(fn, x: torch.Tensor) -> torch.Tensor:
    """The few-row kernel's result, 4 rows at a time (its own chunk)."""
    return torch.cat([fn(x[i:i + 4]) for i in range(0, x.shape[0], 4)])


def _threads(n: int):
    class _T:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)
    return _T()


@needs_build
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 6, 7, 9, 13, 67, 144])
@pytest.mark.parametrize("n,k", [(1, 1), (17, 33), (100, 37), (130, 96), (191, 250)])
def test_rows_match_the_few_row_kernel_bit_for_bit(path, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    gw = GemvWeight(w, path=path)
    assert torch.equal(gemm_bf16(gw, x), _by_fours(gw, x))
    got = gemm_bf16(gw, x, bias)
    assert torch.equal(got, _by_fours(lambda r: gw(r, bias), x))
    # and within bfloat16 rounding of a float64 reference
    want = (x.double() @ w.double().T + bias.double())
    err = (got.double() - want).abs()
    assert bool((err <= want.abs() * 2 ** -8 + 1e-4 * want.abs().max() + 1e-6).all())


@needs_build
@needs_fast
@pytest.mark.parametrize("m", [64, 256])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536)])
def test_model_shapes_match_the_few_row_kernel(m, n, k):
    """SmolLM2's shapes (several row chunks of x at 256 rows x 1536 inputs)."""
    g = torch.Generator().manual_seed(m + n)
    gw = GemvWeight((torch.randn(n, k, generator=g) * 0.05).bfloat16())
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    assert torch.equal(gemm_bf16(gw, x, bias), _by_fours(lambda r: gw(r, bias), x))
    pair = GemvWeight((torch.randn(n, k, generator=g) * 0.05).bfloat16(),
                      (torch.randn(n, k, generator=g) * 0.05).bfloat16())
    assert torch.equal(gemm_bf16_silu_mul(pair, x), _by_fours(pair.silu_mul, x))


@needs_build
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [3, 9, 31, 130])
@pytest.mark.parametrize("n,k", [(5, 9), (33, 40), (70, 65)])
@pytest.mark.parametrize("scale", [1.0, 40.0])  # 40: gate sums past +-88, expf's special range
def test_silu_mul_matches_the_few_row_kernel_bit_for_bit(path, m, n, k, scale):
    g = torch.Generator().manual_seed(m + n + k)
    gate = (torch.randn(n, k, generator=g) * scale).bfloat16()
    up = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    gw = GemvWeight(gate, up, path=path)
    got = gemm_bf16_silu_mul(gw, x)
    assert torch.equal(got, _by_fours(gw.silu_mul, x))
    want = F.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)
    err = (got.double() - want).abs()
    assert bool((err <= want.abs() * 2 ** -7 + 1e-3 * want.abs().max() + 1e-6).all())


@needs_build
@pytest.mark.parametrize("path", PATHS)
def test_threads_strides_and_row_counts_do_not_change_a_row(path):
    """A row's result is the same with 1 or 2 threads, as a column slice of a wider tensor,
    and whatever rows run beside it."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 77, generator=g).bfloat16()
    wide = torch.randn(100, 120, generator=g).bfloat16()
    x = wide[:, 10:87]
    gw = GemvWeight(w, path=path)
    pair = GemvWeight(w, torch.randn(300, 77, generator=g).bfloat16(), path=path)
    with _threads(1):
        one, one_s = gemm_bf16(gw, x), gemm_bf16_silu_mul(pair, x)
    with _threads(2):
        two, two_s = gemm_bf16(gw, x), gemm_bf16_silu_mul(pair, x)
        assert torch.equal(one, two) and torch.equal(one_s, two_s)
        assert torch.equal(one, gemm_bf16(gw, x.contiguous()))
        for rows in (9, 10, 37, 64, 99):
            assert torch.equal(gemm_bf16(gw, x[:rows]), one[:rows])
            assert torch.equal(gemm_bf16(gw, x[rows - 9:rows]), one[rows - 9:rows])
            assert torch.equal(gemm_bf16_silu_mul(pair, x[:rows]), one_s[:rows])


@needs_build
@needs_fast
def test_silu_vector_exp_is_libms_expf():
    """The silu epilogue's vector expf (vec_exp.h) agrees with this libm's expf (checked once at
    load, ops.capabilities()); where it did not, the kernel would use expf itself."""
    assert ops.capabilities().vector_exp


@needs_build
def test_special_values_pass_through():
    w = torch.ones(64, 4).bfloat16()
    x = torch.tensor([[1.0, float("inf"), 0, 0], [1.0, float("nan"), 0, 0],
                      [1e-40, 0, 0, 0]] * 3).bfloat16()
    gw = GemvWeight(w)
    out = gemm_bf16(gw, x)
    assert torch.equal(out.view(torch.int16), _by_fours(gw, x).view(torch.int16))
    out = out.float()
    assert bool(torch.isinf(out[0]).all()) and bool(torch.isnan(out[1]).all())


@needs_build
def test_bad_inputs_are_refused():
    w = torch.randn(8, 16).bfloat16()
    gw, pair = GemvWeight(w), GemvWeight(w, w)
    with pytest.raises(ValueError, match=r"\[M, 16\]"):
        gemm_bf16(gw, torch.randn(12, 15).bfloat16())
    with pytest.raises(ValueError, match="bfloat16"):
        gemm_bf16(gw, torch.randn(12, 16))
    with pytest.raises(ValueError, match="unit column stride"):
        gemm_bf16(gw, torch.randn(16, 12).bfloat16().T)
    with pytest.raises(ValueError, match="bias"):
        gemm_bf16(gw, torch.randn(12, 16).bfloat16(), torch.randn(7).bfloat16())
    with pytest.raises(TypeError, match="silu_mul"):
        gemm_bf16(pair, torch.randn(12, 16).bfloat16())
    with pytest.raises(TypeError, match="single matrix"):
        gemm_bf16_silu_mul(gw, torch.randn(12, 16).bfloat16())
    assert gemm_bf16(gw, torch.randn(0, 16).bfloat16()).shape == (0, 8)
