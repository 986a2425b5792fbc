"""A loaded LoRA adapter's weights, arranged for the model's fused matrices."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

# The projections an adapter may target, under PEFT's (Hugging Face's) module names.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The model's fused products and the projections inside each, in the order of the fused
# matrix's output rows (q/k/v are one matrix; gate and up share one input).
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class ModelDims(Protocol):
    """What an adapter needs of the base model's config (``models/config.py``'s ModelConfig
    has it; lora/ sits below models/, so it asks for the fields, not the class)."""

    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int


@dataclass(frozen=True)
class LoRAModelShape:
    """The base model's shape as an adapter sees it: layer count and each projection's
    (input, output) size."""

    num_layers: int
    dims: dict[str, tuple[int, int]]

    @classmethod
    def from_config(cls, c: ModelDims) -> LoRAModelShape:
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        h, i = c.hidden_size, c.intermediate_size
        return cls(c.num_hidden_layers, {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)})


@dataclass
class LoRAAdapter:
    """Owns one adapter's low-rank matrices: per targeted projection ``a[module]`` [L, r, in]
    and ``b[module]`` [L, out, r] with the scaling (alpha / r, or alpha / sqrt(r) with
    rsLoRA) folded into B. A layer the adapter leaves alone holds zeros, so every layer of a
    projection has the same rank (the step's column layout is shared by all layers)."""

    name: str
    int_id: int
    rank: int
    scaling: float
    a: dict[str, torch.Tensor] = field(default_factory=dict)
    b: dict[str, torch.Tensor] = field(default_factory=dict)
    path: str = ""

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(m for m in MODULES if m in self.a)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.a, self.b) for t in d.values())
