"""Taking a checkpoint's tensors into the layouts the layers multiply with: float matrices in
oneDNN's packed layout, quantized ones packed for their integer kernels."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from llmtower.models.linear import PackedWeight, linear, prepack
from llmtower.models.quant import QuantizedLinear, QuantizedTensor, pack, quantize, quantize_int8

Weight = torch.Tensor | PackedWeight | QuantizedLinear


def apply_linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for a float matrix or a packed quantized one."""
    if isinstance(w, QuantizedLinear):
        return w(x, bias)
    return linear(x, w, bias)


def packed(w: Weight) -> Weight:
    """A float matrix in oneDNN's packed layout (``models/linear.py``); quantized ones as they
    are."""
    return prepack(w) if isinstance(w, torch.Tensor) else w


def fuse(parts: list[torch.Tensor | QuantizedTensor]) -> Weight:
    """Matrices stacked along their rows: one float matrix, or one packed quantized one (a
    float part beside quantized ones is quantized alike)."""
    tensors = [p for p in parts if isinstance(p, torch.Tensor)]
    if len(tensors) == len(parts):
        return torch.cat(tensors).contiguous() if len(tensors) > 1 else tensors[0]
    kind = next(p.kind for p in parts if isinstance(p, QuantizedTensor))
    qs = [p if isinstance(p, QuantizedTensor) else quantize(p, kind) for p in parts]
    if len({(p.kind, p.group_size) for p in qs}) > 1:
        qs = [quantize_int8(p.dequantize()) for p in qs]
    return pack(QuantizedTensor.cat(qs))


class WeightTaker:
    """Takes named tensors out of a state dict with a clear error for a missing or misshapen
    one; ``linear`` also quantizes float matrices when asked (``quantize`` int8 / int4)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor | QuantizedTensor],
                 dtype: torch.dtype, quantize: str | None = None, family: str = "") -> None:
        self.state_dict = state_dict
        self.dtype = dtype
        self.quantize = quantize
        # Named in the missing-tensor error: the family whose layout was expected.
        self.family = family or "Llama-family (Llama, Qwen2, Qwen3, Mistral)"

    def has(self, name: str) -> bool:
        return name in self.state_dict

    def _get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | QuantizedTensor:
        t = self.state_dict.get(name)
        if t is None:
            raise ValueError(f"the checkpoint lacks tensor {name!r}: is it a complete "
                             f"{self.family} checkpoint?")
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)} but config.json implies "
                             f"{shape}: the weights do not match the config")
        return t

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self._get(name, shape)
        if isinstance(t, QuantizedTensor):
            t = t.dequantize()
        return t.to(self.dtype).contiguous()

    def optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The tensor if the checkpoint has it, else None."""
        return self(name, shape) if self.has(name) else None

    def linear(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | QuantizedTensor:
        """A linear layer's weight: quantized if the checkpoint holds it so or if asked to."""
        t = self._get(name, shape)
        if isinstance(t, QuantizedTensor):
            return t
        if self.quantize is not None:
            return quantize(t, self.quantize)  # type: ignore[arg-type]
        return t.to(self.dtype).contiguous()
