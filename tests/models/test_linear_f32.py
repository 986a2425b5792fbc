"""float32 products in the model: decode-step row counts take kernels/gemm_f32.c, larger ones
oneDNN's packed GEMM, and greedy decoding gives the same tokens either way."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtower.kernels import ops
from llmtower.models import linear as L

needs_kernel = pytest.mark.skipif(L.prepack is L._identity or ops.capabilities().why_not("gemm_f32") is not None,
                                  reason="no oneDNN packing or no AVX-512 here")


@needs_kernel
def test_linear_takes_the_kernel_up_to_the_threshold_and_onednn_beyond(monkeypatch):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(200, 96, generator=g)
    up = torch.randn(200, 96, generator=g)
    bias = torch.randn(200, generator=g)
    pw = L.prepack(w)
    assert isinstance(pw, L.PackedWeight) and pw.f32 and tuple(pw.shape) == (200, 96)
    gate_pair, pup = L.prepack_gate_up(w, up)
    assert isinstance(gate_pair, L.PackedWeight) and gate_pair.gemv.silu_pair
    x = torch.randn(L.F32_KERNEL_MAX_ROWS + 1, 96, generator=g)
    few = x[:L.F32_KERNEL_MAX_ROWS]
    assert torch.equal(L.linear(few, pw, bias), pw.gemv(few, bias))
    assert torch.equal(L.silu_mul(few, gate_pair, pup), gate_pair.gemv.silu_mul(few))
    assert torch.equal(L.linear(x, pw), L.linear(x, pw.onednn))
    want = x.double() @ w.double().T
    torch.testing.assert_close(L.linear(few, pw).double(), want[:len(few)], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(L.silu_mul(few, gate_pair, pup).double(),
                               F.silu(want[:len(few)]) * (few.double() @ up.double().T),
                               rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(L, "F32_KERNEL_MAX_ROWS", 0)  # off: oneDNN at every row count
    assert torch.equal(L.linear(few, pw), L.linear(few, pw.onednn))
    assert torch.equal(L.silu_mul(few, gate_pair, pup), L.silu_mul(few, gate_pair.onednn, pup))


@needs_kernel
def test_bfloat16_weights_keep_their_own_kernel():
    pw = L.prepack(torch.randn(64, 32).bfloat16())
    if isinstance(pw, L.PackedWeight):  # where the bfloat16 few-row kernel runs
        assert not pw.f32


@needs_kernel
def test_tiny_model_greedy_decode_unchanged_by_the_kernel(tiny_llama_dir, monkeypatch):
    """float32 greedy decoding of 1 and 5 requests (rows per step inside the kernel's range)
    gives the tokens oneDNN gives."""
    from tests.executor.exactness_helpers import add_greedy, make_engine, random_prompts, run_all
    prompts = random_prompts(5, 3, 60, seed=2)

    def greedy(batch: list[list[int]]) -> list[list[int]]:
        core = make_engine(tiny_llama_dir, dtype="float32")
        add_greedy(core, batch, 24)
        out = run_all(core)
        return [out[str(i)] for i in range(len(batch))]

    with_kernel = greedy(prompts), greedy(prompts[:1])
    monkeypatch.setattr(L, "F32_KERNEL_MAX_ROWS", 0)
    assert (greedy(prompts), greedy(prompts[:1])) == with_kernel
