"""The one-call mixture-of-experts decode kernel (kernels/moe_experts.c) against the per-expert
torch path of models/layers/moe.py: the same tokens bit for bit, in bfloat16 and float32, on
the fast and the portable code, at one and two threads, with shapes off the tiles' sizes."""
from __future__ import annotations

import pytest
import torch

from llmtower.kernels import ops
from llmtower.kernels.moe_experts import MoEExperts
from llmtower.models.layers.mlp import GatedMLP
from llmtower.models.layers.moe import Routing, SparseMoE

NUM_EXPERTS = 8


def _block(dtype: torch.dtype, hidden: int, inter: int, top_k: int, seed: int
           ) -> tuple[SparseMoE, list[tuple[torch.Tensor, ...]]]:
    """A block of NUM_EXPERTS SwiGLU experts, and each expert's plain (gate, up, down)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.3).to(dtype)

    plain = [(w(inter, hidden), w(inter, hidden), w(hidden, inter)) for _ in range(NUM_EXPERTS)]
    experts = [GatedMLP(*m, "silu") for m in plain]
    return SparseMoE(w(NUM_EXPERTS, hidden), experts, Routing(top_k, True)), plain


def _need(dtype: torch.dtype) -> None:
    why = ops.capabilities().why_not_in("moe_experts", dtype)
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hidden", "inter", "top_k"), [(136, 88, 4), (201, 45, 3)])
def test_kernel_equals_per_expert_path(dtype, hidden, inter, top_k):
    _need(dtype)
    block, plain = _block(dtype, hidden, inter, top_k, seed=hidden)
    assert block.kernel is not None, "the block should have taken the kernel"
    routed = block.kernel
    gate_up = [e.gate.gemv for e in block.experts]  # type: ignore[union-attr]
    down = [e.down.gemv for e in block.experts]  # type: ignore[union-attr]
    kernel = MoEExperts(gate_up, down)  # routed by torch: bit for bit the per-expert path
    portable = MoEExperts(gate_up, down, path=1)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(7)).to(dtype)
    threads = torch.get_num_threads()
    try:
        for rows in (x[:1], x):  # one token (the one-token path) and three (the grouped path)
            with_kernel = {}
            for n in (1, 2):
                torch.set_num_threads(n)
                block.kernel = kernel
                with_kernel[n] = block(rows)
                ids, weights = block.route(rows)
                assert torch.equal(portable(rows, ids, weights), with_kernel[n])
            block.kernel = None
            expected = block(rows)
            assert torch.equal(with_kernel[1], expected)
            assert torch.equal(with_kernel[2], expected)
            # and both are the mixture: against a float64 computation of it
            ids, weights = block.route(rows)
            ref = torch.zeros(rows.shape, dtype=torch.float64)
            for t in range(rows.shape[0]):
                xt = rows[t].double()
                for j in range(top_k):
                    gate, up, down = (m.double() for m in plain[int(ids[t, j])])
                    h = torch.nn.functional.silu(gate @ xt) * (up @ xt)
                    ref[t] += weights[t, j].double() * (down @ h)
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            assert torch.allclose(expected.double(), ref, atol=tol * ref.abs().max().item())
    finally:
        torch.set_num_threads(threads)
        block.kernel = routed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize", [True, False])
def test_routing_in_the_call_picks_torchs_experts(dtype, normalize):
    """The kernel's own routing (softmax, top k, renormalized or not) against torch's: the same
    experts and weights up to the logits' summation order."""
    _need(dtype)
    block, _ = _block(dtype, 136, 88, 3, seed=5)
    block.routing.normalize = normalize
    block.router = (block.router.float() / 30).to(dtype)  # spread the weights: top 3 of 8 ~ 1/2
    block.kernel = type(block.kernel)(  # type: ignore[misc]
        [e.gate.gemv for e in block.experts], [e.down.gemv for e in block.experts],  # type: ignore[union-attr]
        block.router, normalize)
    x = torch.randn(4, 136, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = block(x)
    kernel, block.kernel = block.kernel, None
    expected = block(x)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.float(), expected.float(), atol=tol * expected.abs().max().item())
    # renormalizing or not changes the output by ~2x: the comparison above tells them apart
    _, weights = block.route(x)
    assert kernel is not None and kernel.router is not None
    assert bool((weights.sum(-1) < 0.8).all()) != normalize


def test_bad_ids_are_refused():
    _need(torch.float32)
    block, _ = _block(torch.float32, 64, 32, 2, seed=1)
    assert block.kernel is not None
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="expert ids"):
        block.kernel(x, torch.tensor([[0, NUM_EXPERTS]]), torch.tensor([[0.5, 0.5]]))
    with pytest.raises(ValueError, match="float32"):
        block.kernel(x, torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    with pytest.raises(ValueError, match="x must be"):
        block.kernel(x.bfloat16(), torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]]))


def test_mixed_experts_keep_the_torch_path():
    """Experts the kernel cannot compute (biases, another activation) run one by one."""
    experts = [GatedMLP(torch.randn(16, 32), torch.randn(16, 32), torch.randn(32, 16),
                        "gelu_pytorch_tanh") for _ in range(4)]
    block = SparseMoE(torch.randn(4, 32), experts, Routing(2, True))
    assert block.kernel is None
    x = torch.randn(1, 32)
    ids, weights = block.route(x)
    expected = sum(weights[0, j] * experts[int(ids[0, j])](x) for j in range(2))
    assert torch.allclose(block(x), expected, atol=1e-5)
