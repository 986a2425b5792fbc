"""The bfloat16 few-row kernel (kernels/gemv_bf16.c) against float32 references, on both of its
paths (AVX512_BF16 where this CPU has it, and the portable C code). Its use in the model:
tests/models/test_linear.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtower.kernels import ops
from llmtower.kernels.build import KernelUnavailable
from llmtower.kernels.gemv_bf16 import GemvWeight

try:
    from llmtower.kernels.gemv_bf16 import _lib
    _lib()
    BUILT = True
except KernelUnavailable:
    BUILT = False
needs_build = pytest.mark.skipif(not BUILT, reason="no C compiler")
PATHS = [0, 1] if ops.capabilities().why_not("gemv_bf16") is None else [1]


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within bfloat16 rounding of the float32 result (plus float32 summation order)."""
    err = (got.float() - want).abs()
    bound = want.abs() * 2 ** -8 + 1e-4 * want.abs().max() + 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())


@needs_build
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("n,k", [(1, 1), (17, 33), (100, 37), (130, 96), (191, 250)])
def test_rows_times_matrix_match_float32(path, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    gw = GemvWeight(w, path=path)
    want = x.float() @ w.float().T
    _bf16_close(gw(x), want)
    _bf16_close(gw(x, bias), want + bias.float())


@needs_build
@pytest.mark.parametrize("path", PATHS)
def test_strided_rows_and_threads(path):
    """Rows of a wider tensor (a column slice) and one or two threads give the same result."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 77, generator=g).bfloat16()
    wide = torch.randn(6, 120, generator=g).bfloat16()
    x = wide[:, 10:87]
    gw = GemvWeight(w, path=path)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gw(x)
        torch.set_num_threads(2)
        two = gw(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert torch.equal(one, gw(x.contiguous()))
    _bf16_close(one, x.float() @ w.float().T)


@needs_build
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 3, 6])
@pytest.mark.parametrize("n,k", [(5, 9), (33, 40), (70, 65)])
def test_silu_mul_matches_float32(path, m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    gate = torch.randn(n, k, generator=g).bfloat16()
    up = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    gw = GemvWeight(gate, up, path=path)
    want = F.silu(x.float() @ gate.float().T) * (x.float() @ up.float().T)
    got = gw.silu_mul(x).float()
    # silu(gate) is rounded to bfloat16 before the product (as oneDNN's fused path does)
    err = (got - want).abs()
    assert bool((err <= want.abs() * 2 ** -7 + 1e-3 * want.abs().max() + 1e-6).all())


@needs_build
def test_fast_and_portable_paths_agree():
    if ops.capabilities().why_not("gemv_bf16") is not None:
        pytest.skip(ops.capabilities().why_not("gemv_bf16"))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(257, 191, generator=g).bfloat16()
    x = torch.randn(5, 191, generator=g).bfloat16()
    fast, portable = GemvWeight(w)(x).float(), GemvWeight(w, path=1)(x).float()
    # the same sums in the same order; only how each pair of products is rounded may differ
    assert (fast != portable).float().mean() < 0.01
    torch.testing.assert_close(fast, portable, rtol=2 ** -7, atol=1e-3)


@needs_build
def test_bad_inputs_are_refused():
    w = torch.randn(8, 16).bfloat16()
    with pytest.raises(TypeError, match="bfloat16"):
        GemvWeight(w.float())
    with pytest.raises(ValueError, match="one shape"):
        GemvWeight(w, torch.randn(8, 15).bfloat16())
    gw = GemvWeight(w)
    with pytest.raises(ValueError, match=r"\[M, 16\]"):
        gw(torch.randn(2, 15).bfloat16())
    with pytest.raises(ValueError, match="bfloat16"):
        gw(torch.randn(2, 16))
    with pytest.raises(TypeError, match="silu_mul"):
        GemvWeight(w, w)(torch.randn(1, 16).bfloat16())
