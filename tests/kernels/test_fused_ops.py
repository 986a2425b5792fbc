"""The fused per-layer kernels against the torch code they replace (models/llama.py, rope.py,
attention.py's KV write), in float32 and bfloat16, for 1 row (a decode) and many (threads)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtower.kernels import ops
from llmtower.kernels.fused_ops import FusedOps
from llmtower.models.llama import rms_norm
from llmtower.models.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(ops.capabilities().why_not("fused_ops") is not None, reason="no C compiler here")
DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    if want.dtype == torch.bfloat16:  # one rounding apart at most: a bfloat16 ulp
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    else:  # summation order and fused multiply-adds only
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 37])
def test_add_rms_norm_is_residual_add_then_transformers_rmsnorm(dtype, rows):
    torch.manual_seed(0)
    fo = FusedOps(dtype)
    h = torch.randn(rows, 96).to(dtype)
    x = torch.randn(rows, 96).to(dtype)
    w = (1 + 0.1 * torch.randn(96)).to(dtype)
    want_h = h + x
    want = rms_norm(want_h, w, 1e-5)
    got = fo.add_rms_norm(h, x, w, 1e-5)
    assert torch.equal(h, want_h)  # the residual is updated in place, rounded as torch rounds
    _close(got, want)
    _close(fo.add_rms_norm(h, None, w, 1e-5), rms_norm(h, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 40])
def test_rope_kv_write_rotates_and_stores_like_the_torch_path(dtype, rows):
    torch.manual_seed(1)
    fo = FusedOps(dtype)
    nh, nkv, d, bs, blocks = 6, 2, 16, 4, 32
    rope = RotaryEmbedding(d, 128, 10000.0, None, dtype)
    qkv = torch.randn(rows, (nh + 2 * nkv) * d).to(dtype)
    positions = torch.randint(0, 128, (rows,))
    slots = torch.randperm(blocks * bs)[:rows]
    cache = torch.zeros(2, blocks, bs, nkv, d, dtype=dtype)
    fo.check_step(positions, slots, 128, blocks * bs)
    cos, sin = rope.tables()
    q, k = fo.rope_kv_write(qkv, nh, nkv, d, cos, sin, positions, slots, cache, want_k=True)

    c, s = rope.lookup(positions)
    qk = rope.apply(qkv[:, :(nh + nkv) * d].view(rows, nh + nkv, d), c, s)
    v = qkv[:, (nh + nkv) * d:].view(rows, nkv, d)
    _close(q, qk[:, :nh])
    assert k is not None
    _close(k, qk[:, nh:])
    want = torch.zeros_like(cache)
    want[0].view(-1, nkv, d).index_copy_(0, slots, qk[:, nh:])
    want[1].view(-1, nkv, d).index_copy_(0, slots, v)
    _close(cache, want)
    assert torch.equal(cache[1], want[1])  # v is copied, not computed


def test_check_step_refuses_indices_outside_the_tables():
    fo = FusedOps(torch.float32)
    ok = torch.tensor([0, 5])
    with pytest.raises(ValueError, match="positions"):
        fo.check_step(torch.tensor([0, 128]), ok, 128, 64)
    with pytest.raises(ValueError, match="slots"):
        fo.check_step(ok, torch.tensor([3, 64]), 128, 64)
    with pytest.raises(ValueError, match="int64"):
        fo.check_step(ok.int(), ok, 128, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
def test_silu_mul_is_silu_of_the_first_half_times_the_second(dtype, rows):
    torch.manual_seed(2)
    y = (3 * torch.randn(rows, 2 * 80)).to(dtype)
    _close(FusedOps(dtype).silu_mul(y), F.silu(y[:, :80]) * y[:, 80:])
