"""The model's fused products with a step's LoRA rows added (``models/llama.py`` calls these
only when the step has adapter rows)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from llmtower.lora.punica import LoRAStep
from llmtower.kernels.gemm_f32 import GemmF32Weight
from llmtower.models import linear as linear_mod
from llmtower.models.linear import PackedWeight, linear, silu_mul

if TYPE_CHECKING:
    from llmtower.models.llama import DecoderLayerWeights


def add_qkv(lora: LoRAStep, layer: int, x: torch.Tensor, qkv: torch.Tensor, q_size: int,
            kv_size: int) -> torch.Tensor:
    """The fused q/k/v rows plus the adapters' q, k and v products (in place)."""
    if lora.targets("qkv"):
        lora.add(layer, "qkv", x, qkv[:, :q_size], qkv[:, q_size:q_size + kv_size],
                 qkv[:, q_size + kv_size:])
    return qkv


def add_o(lora: LoRAStep, layer: int, o: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if lora.targets("o"):
        lora.add(layer, "o", o, out)
    return out


def mlp(lora: LoRAStep, layer: int, x: torch.Tensor, w: DecoderLayerWeights) -> torch.Tensor:
    """The SwiGLU MLP with the adapters' gate, up and down products. With a gate or up
    adapter, SiLU needs the gate's sum whole, so gate and up run as two products instead of
    the fused SiLU-and-multiply GEMM."""
    from llmtower.models.llama import apply_linear

    if w.gate_up is not None:  # quantized: one product for gate and up
        y = w.gate_up(x)
        i = y.shape[1] // 2
        if lora.targets("gate_up"):
            lora.add(layer, "gate_up", x, y[:, :i], y[:, i:])
        act = F.silu(y[:, :i]).mul_(y[:, i:])
    elif lora.targets("gate_up"):
        assert w.gate is not None and w.up is not None
        g, u = _gate_and_up(x, w.gate, w.up)
        lora.add(layer, "gate_up", x, g, u)
        act = F.silu(g).mul_(u)
    else:
        act = silu_mul(x, w.gate, w.up)
    out = apply_linear(act, w.down)
    if lora.targets("down"):
        lora.add(layer, "down", act, out)
    return out


def _gate_and_up(x: torch.Tensor, gate: torch.Tensor | PackedWeight,
                 up: torch.Tensor | PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate's and up's products apart: from the fused pair's panels in one pass where
    the float32 decode kernel holds them (as ``silu_mul`` would read them), else two
    oneDNN products."""
    if isinstance(gate, PackedWeight) and isinstance(gate.gemv, GemmF32Weight) \
            and gate.gemv.silu_pair and x.shape[0] <= linear_mod.F32_KERNEL_MAX_ROWS \
            and x.dtype == torch.float32:
        return gate.gemv.pair_products(x.contiguous())
    return linear(x, _plain(gate)), linear(x, _plain(up))


def _plain(w: torch.Tensor | PackedWeight) -> torch.Tensor:
    """The oneDNN copy of a packed matrix: the gate's decode-kernel copy interleaves gate and
    up for the fused SiLU product, which cannot give the gate's sum alone."""
    return w.onednn if isinstance(w, PackedWeight) else w
