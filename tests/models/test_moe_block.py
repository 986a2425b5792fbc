"""The mixture-of-experts block (models/layers/moe.py): equal to a dense reference that weighs
every expert by its routing weight, while running only the experts that got tokens, once each."""
from __future__ import annotations

import pytest
import torch

from llmtower.models.layers.mlp import GatedMLP
from llmtower.models.layers.moe import Routing, SparseMoE

H, INTER, E, K = 32, 24, 8, 2  # hidden, intermediate, experts, experts per token


class Counting:
    """An expert that counts its calls and rows."""

    def __init__(self, mlp: GatedMLP) -> None:
        self.mlp, self.calls, self.rows = mlp, 0, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.rows += x.shape[0]
        return self.mlp(x)


@pytest.fixture(scope="module")
def parts():
    g = torch.Generator().manual_seed(0)
    mats = [[torch.randn(INTER, H, generator=g) * 0.3, torch.randn(INTER, H, generator=g) * 0.3,
             torch.randn(H, INTER, generator=g) * 0.3] for _ in range(E)]
    return torch.randn(E, H, generator=g), mats


def _reference(x, router, mats, routing):
    probs = torch.softmax(x @ router.T, dim=-1)
    w, ids = torch.topk(probs, routing.top_k, dim=-1)
    if routing.normalize:
        w = w / w.sum(-1, keepdim=True)
    dense = torch.zeros(x.shape[0], E)
    dense.scatter_(1, ids, w)
    out = torch.zeros_like(x)
    for e, (gate, up, down) in enumerate(mats):
        out += dense[:, e:e + 1] * ((torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T)
    return out


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("normalize", [True, False])
def test_equals_the_dense_reference_running_only_chosen_experts(parts, rows, normalize):
    router, mats = parts
    routing = Routing(K, normalize)
    experts = [Counting(GatedMLP(g, u, d, "silu")) for g, u, d in mats]
    moe = SparseMoE(router, experts, routing)  # type: ignore[arg-type]
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(moe(x), _reference(x, router, mats, routing), atol=1e-5, rtol=1e-5)
    ids, _ = moe.route(x)
    chosen = set(ids.flatten().tolist())
    # One call per chosen expert, none for the others; rows add up to rows * k.
    assert [e.calls for e in experts] == [int(i in chosen) for i in range(E)]
    assert sum(e.rows for e in experts) == rows * K
