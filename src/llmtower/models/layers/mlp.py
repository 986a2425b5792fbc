"""Gated MLPs: ``down(act(gate(x)) * up(x))`` with SiLU (SwiGLU), tanh-GELU (GeGLU), or
gpt-oss's clamped SwiGLU (``(up + 1) * gate * sigmoid(alpha * gate)``, both clamped)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from llmtower.models.layers.weights import StateValue, Weight, WeightTaker, apply_linear, fuse, packed
from llmtower.models.linear import PackedWeight, prepack_gate_up, silu_mul

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "swiglu_oss")
# gpt-oss's swiglu_alpha and swiglu_limit defaults.
OSS_ALPHA, OSS_LIMIT = 1.702, 7.0


class GatedMLP:
    """Owns one gated MLP's matrices. Float SiLU MLPs keep gate and up packed for
    ``silu_mul`` (the activation runs inside the GEMM); the rest multiply one fused
    gate/up matrix and split it."""

    def __init__(self, gate: StateValue, up: StateValue,
                 down: StateValue, act: str,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                 alpha: float = OSS_ALPHA, limit: float = OSS_LIMIT) -> None:
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={act!r} is not supported: one of {', '.join(ACTIVATIONS)}")
        self.act = act
        self.intermediate = gate.shape[0]
        self.down = packed(fuse([down]))
        self.gate: torch.Tensor | PackedWeight | None = None
        self.up: torch.Tensor | PackedWeight | None = None
        self.gate_up: Weight | None = None
        self.gate_up_bias, self.down_bias = gate_up_bias, down_bias  # [2 * I] (gate, up), [H]
        self.alpha, self.limit = alpha, limit
        if act == "silu" and isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor) \
                and gate_up_bias is None and down_bias is None:
            self.gate, self.up = prepack_gate_up(gate, up)
        else:
            self.gate_up = packed(fuse([gate, up]))

    @classmethod
    def load(cls, take: WeightTaker, prefix: str, hidden: int, intermediate: int, act: str,
             names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> GatedMLP:
        """The MLP under ``prefix`` (e.g. ``model.layers.3.mlp.``) with HF's matrix names."""
        g, u, d = names
        return cls(take.linear(prefix + g + ".weight", (intermediate, hidden)),
                   take.linear(prefix + u + ".weight", (intermediate, hidden)),
                   take.linear(prefix + d + ".weight", (hidden, intermediate)), act)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            assert self.gate is not None and self.up is not None
            return apply_linear(silu_mul(x, self.gate, self.up), self.down)
        y = apply_linear(x, self.gate_up, self.gate_up_bias)
        i = self.intermediate
        if self.act == "silu":
            h = F.silu(y[:, :i]).mul_(y[:, i:])
        elif self.act == "gelu_pytorch_tanh":
            h = F.gelu(y[:, :i], approximate="tanh").mul_(y[:, i:])
        else:
            g = y[:, :i].clamp(max=self.limit)
            h = (y[:, i:].clamp(-self.limit, self.limit) + 1) * (g * torch.sigmoid(g * self.alpha))
        return apply_linear(h, self.down, self.down_bias)
