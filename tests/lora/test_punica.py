"""The batched low-rank product against a plain per-row computation: rows of several adapters
of different ranks and rows without one, in any order, and after ``select``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmtower.kernels import ops
from llmtower.kernels.gemm_f32 import GemmF32Weight
from llmtower.lora.adapter import LoRAAdapter
from llmtower.lora.punica import LoRAStep, StackedLoRA

D_IN, D_Q, D_KV, LAYERS = 24, 24, 8, 2


def _adapter(int_id: int, rank: int, modules: tuple[str, ...], seed: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    dims = {"q_proj": D_Q, "k_proj": D_KV, "v_proj": D_KV}
    a = {m: torch.randn(LAYERS, rank, D_IN, generator=g) for m in modules}
    b = {m: torch.randn(LAYERS, dims[m], rank, generator=g) for m in modules}
    return LoRAAdapter(f"a{int_id}", int_id, rank, 1.0, a, b)


def test_grouped_product_equals_per_row_product():
    adapters = [_adapter(1, 4, ("q_proj", "v_proj"), 1), _adapter(2, 8, ("k_proj",), 2),
                _adapter(3, 2, ("q_proj", "k_proj", "v_proj"), 3)]
    stack = StackedLoRA(adapters, LAYERS, torch.float32)
    row_slot = np.array([2, -1, 0, 0, 1, -1, 2, 0, 1])
    x = torch.randn(len(row_slot), D_IN)
    for layer in range(LAYERS):
        qkv = torch.randn(len(row_slot), D_Q + 2 * D_KV)
        want = qkv.clone()
        for i, s in enumerate(row_slot):
            if s < 0:
                continue
            ad = adapters[s]
            off = 0
            for m, d in (("q_proj", D_Q), ("k_proj", D_KV), ("v_proj", D_KV)):
                if m in ad.a:
                    want[i, off:off + d] += ad.b[m][layer] @ (ad.a[m][layer] @ x[i])
                off += d
        delta = want - qkv
        step = LoRAStep(stack, row_slot)
        step.add(layer, "qkv", x, qkv[:, :D_Q], qkv[:, D_Q:D_Q + D_KV], qkv[:, D_Q + D_KV:])
        torch.testing.assert_close(qkv, want, rtol=1e-5, atol=1e-5)
        # After keeping some rows (the model's sampled rows), each keeps its adapter.
        keep = torch.tensor([1, 4, 6])
        sub = LoRAStep(stack, row_slot).select(keep)
        q2 = torch.zeros(3, D_Q + 2 * D_KV)
        sub.add(layer, "qkv", x[keep], q2[:, :D_Q], q2[:, D_Q:D_Q + D_KV], q2[:, D_Q + D_KV:])
        torch.testing.assert_close(q2, delta[keep], rtol=1e-5, atol=1e-5)
        assert not q2[0].any()  # the base row gets nothing


@pytest.mark.skipif(not ops.capabilities().can_run("gemm_f32"), reason="no float32 decode kernel here")
@pytest.mark.parametrize("n", [64, 40])
def test_pair_products_read_gate_and_up_apart(n):
    g, u, x = torch.randn(n, 32), torch.randn(n, 32), torch.randn(7, 32)
    gate, up = GemmF32Weight(g, u).pair_products(x)
    torch.testing.assert_close(gate, x @ g.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(up, x @ u.T, rtol=1e-5, atol=1e-5)


def test_segmented_form_equals_padded_form():
    """One adapter's prefill chunk beside single rows of others: the segmented form (chosen
    for the padding it saves) gives what the padded form gives."""
    adapters = [_adapter(1, 4, ("q_proj", "k_proj"), 1), _adapter(2, 8, ("v_proj",), 2),
                _adapter(3, 2, ("q_proj",), 3)]
    stack = StackedLoRA(adapters, LAYERS, torch.float32)
    row_slot = np.array([1, 2, -1] + [0] * 20)
    x = torch.randn(len(row_slot), D_IN)
    seg = LoRAStep(stack, row_slot)
    assert seg.segments is not None
    pad = LoRAStep(stack, row_slot)
    pad.segments = None
    outs = []
    for step in (seg, pad):
        qkv = torch.zeros(len(row_slot), D_Q + 2 * D_KV)
        step.add(1, "qkv", x, qkv[:, :D_Q], qkv[:, D_Q:D_Q + D_KV], qkv[:, D_Q + D_KV:])
        outs.append(qkv)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert outs[0][0, D_Q + D_KV:].any() and not outs[0][2].any()
