"""The model's GEMMs: weights packed once at load give exactly the plain weights' results."""
from __future__ import annotations

import pytest
import torch

import llmtower.models.llama as llama_module
from llmtower.models import linear as L
from tests.models.test_llama import IDS, our_logits

needs_packing = pytest.mark.skipif(L.prepack is L._identity,
                                   reason="this torch has no oneDNN weight packing")


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_weight_gives_the_plain_weights_results(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(160, 96, generator=g).to(dtype)
    up = torch.randn(160, 96, generator=g).to(dtype)
    bias = torch.randn(160, generator=g).to(dtype)
    pw, pup = L.prepack(w), L.prepack(up)
    assert pw.is_mkldnn and tuple(pw.shape) == (160, 96)
    if rows > 1:  # one float32 row: the plain weight takes a GEMV (another summation order)
        assert torch.equal(L.linear(x, pw, bias), L.linear(x, w, bias))
        assert torch.equal(L.silu_mul(x, pw, pup), L.silu_mul(x, w, up))
    torch.testing.assert_close(L.linear(x, pw).float(), (x.float() @ w.float().T),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_do_not_depend_on_the_batch_beside_them(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 96, generator=g).to(dtype)
    pw = L.prepack(torch.randn(160, 96, generator=g).to(dtype))
    full = L.linear(x, pw)
    for rows in (1, 2, 5, 64):
        assert torch.equal(L.linear(x[:rows], pw), full[:rows])


def test_prepack_leaves_other_tensors_alone():
    v = torch.randn(8)
    assert L.prepack(v) is v
    i = torch.ones(4, 4, dtype=torch.int8)
    assert L.prepack(i) is i


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_logits_unchanged_by_packing(dtype, tiny_llama_dir, monkeypatch):
    packed = our_logits(tiny_llama_dir, IDS, dtype)
    monkeypatch.setattr(llama_module, "prepack", L._identity)
    plain = our_logits(tiny_llama_dir, IDS, dtype)
    assert torch.equal(packed, plain)
