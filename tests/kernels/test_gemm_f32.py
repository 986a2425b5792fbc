"""The float32 decode-step GEMM kernel (kernels/gemm_f32.c) against float64 references, on
both of its paths (AVX-512 where this CPU has it, and the portable C code). Its use in the
model: tests/models/test_linear_f32.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtower.kernels import ops
from llmtower.kernels.build import KernelUnavailable
from llmtower.kernels.gemm_f32 import GemmF32Weight

try:
    from llmtower.kernels.gemm_f32 import _lib
    _lib()
    BUILT = True
except KernelUnavailable:
    BUILT = False
needs_build = pytest.mark.skipif(not BUILT, reason="no C compiler")
needs_fast = pytest.mark.skipif(not BUILT or ops.capabilities().why_not("gemm_f32") is not None,
                                reason="no AVX-512 here: only the portable path runs")
PATHS = [0, 1] if BUILT and ops.capabilities().why_not("gemm_f32") is None else [1]


def _close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    """Within float32 summation error of the float64 result (k terms)."""
    err = (got.double() - want).abs()
    bound = 4 * k * 2 ** -24 * want.abs().max() + 1e-30
    assert bool((err <= bound).all()), float((err - bound).max())


@needs_build
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 5, 12, 13, 64, 131])
@pytest.mark.parametrize("n,k", [(1, 1), (17, 33), (64, 96), (100, 37), (200, 250)])
def test_rows_times_matrix_match_float64(path, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    gw = GemmF32Weight(w, path=path)
    want = x.double() @ w.double().T
    out = gw(x)
    assert out.shape == (m, n) and out.dtype == torch.float32
    _close(out, want, k)
    _close(gw(x, bias), want + bias.double(), k)


@needs_build
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,n,k", [(1, 16, 8), (7, 40, 33), (64, 96, 64), (30, 1, 5)])
def test_silu_mul_matches_float64(path, m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    gate = torch.randn(n, k, generator=g)
    up = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g) * 2
    out = GemmF32Weight(gate, up, path=path).silu_mul(x)
    gd, ud = x.double() @ gate.double().T, x.double() @ up.double().T
    want = F.silu(gd) * ud
    # the products' own error, carried through silu (slope <= 1.1) and the product
    tol = 8 * k * 2 ** -24 * (gd.abs().max() * ud.abs().max() + 1) + 1e-6 * want.abs()
    assert bool(((out.double() - want).abs() <= tol).all())


@needs_fast
def test_fast_path_sums_as_the_portable_one():
    """The AVX-512 path's sums equal the portable C code's bit for bit (k order, fused
    multiply-adds); its vectorised silu is within a few ulps of expf's."""
    g = torch.Generator().manual_seed(3)
    w, up = torch.randn(250, 300, generator=g), torch.randn(250, 300, generator=g)
    x, bias = torch.randn(77, 300, generator=g), torch.randn(250, generator=g)
    assert torch.equal(GemmF32Weight(w)(x, bias), GemmF32Weight(w, path=1)(x, bias))
    fast = GemmF32Weight(w, up).silu_mul(x)
    slow = GemmF32Weight(w, up, path=1).silu_mul(x)
    torch.testing.assert_close(fast, slow, rtol=4e-7, atol=1e-6)


@needs_build
@pytest.mark.parametrize("path", PATHS)
def test_a_row_does_not_depend_on_rows_beside_it_threads_or_stride(path):
    """A row's result is the same alone, in a batch of 300 (several row chunks), with one or
    two threads, and read from a wider tensor (strided rows)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(130, 1536, generator=g)
    wide = torch.randn(300, 1600, generator=g)
    x = wide[:, 20:1556]
    gw = GemmF32Weight(w, path=path)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = gw(x)
        torch.set_num_threads(1)
        one_thread = gw(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(full, one_thread)
    for rows in (1, 2, 13, 64, 121):
        assert torch.equal(gw(x[:rows].contiguous()), full[:rows])
    assert torch.equal(gw(x[7:8]), full[7:8])


@needs_build
def test_bad_inputs_get_clear_errors():
    w = torch.randn(32, 16)
    gw = GemmF32Weight(w)
    with pytest.raises(TypeError, match="float32"):
        GemmF32Weight(w.bfloat16())
    with pytest.raises(ValueError, match="one shape"):
        GemmF32Weight(w, torch.randn(32, 8))
    with pytest.raises(ValueError, match=r"float32 \[M, 16\]"):
        gw(torch.randn(4, 15))
    with pytest.raises(ValueError, match=r"float32 \[M, 16\]"):
        gw(torch.randn(4, 16).bfloat16())
    with pytest.raises(ValueError, match="column stride"):
        gw(torch.randn(16, 4).T)
    with pytest.raises(ValueError, match="row stride"):
        gw(torch.randn(1, 16).expand(4, 16))
    with pytest.raises(ValueError, match="bias"):
        gw(torch.randn(4, 16), torch.randn(31))
    with pytest.raises(TypeError, match="call silu_mul"):
        GemmF32Weight(w, w)(torch.randn(2, 16))
    with pytest.raises(TypeError, match="not silu_mul"):
        gw.silu_mul(torch.randn(2, 16))
    assert gw(torch.randn(0, 16)).shape == (0, 32)
