"""Taking a checkpoint's tensors into the layouts the layers multiply with: float matrices in
oneDNN's packed layout, quantized ones packed for their integer kernels."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from llmtower.models.linear import PackedWeight, linear, prepack
from llmtower.models.quant import QuantizedLinear, QuantizedTensor, pack, quantize, quantize_int8
from llmtower.models.quant_block import (BlockEmbedding, BlockQuantLinear, GGUFMatrix,
                                         block_linear, has_block_kernel)

Weight = torch.Tensor | PackedWeight | QuantizedLinear | BlockQuantLinear
# What a state dict holds: float tensors, int8/int4 ones, or a GGUF's block matrices in the file.
StateValue = torch.Tensor | QuantizedTensor | GGUFMatrix


def apply_linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for a float matrix or a packed quantized one."""
    if isinstance(w, (QuantizedLinear, BlockQuantLinear)):
        return w(x, bias)
    return linear(x, w, bias)


def packed(w: Weight) -> Weight:
    """A float matrix in oneDNN's packed layout (``models/linear.py``); quantized ones as they
    are."""
    return prepack(w) if isinstance(w, torch.Tensor) else w


def embed(table: torch.Tensor | BlockEmbedding, ids: torch.Tensor, dtype: torch.dtype
          ) -> torch.Tensor:
    """The embedding rows of ``ids`` in ``dtype`` (a GGUF's block table: only those rows
    dequantized)."""
    if isinstance(table, BlockEmbedding):
        return table(ids, dtype)
    return torch.nn.functional.embedding(ids, table)


def fuse(parts: list[StateValue]) -> Weight:
    """Matrices stacked along their rows: one float matrix, or one packed quantized one (a
    float part beside quantized ones is quantized alike; GGUF blocks beside float parts are
    dequantized)."""
    if any(isinstance(p, GGUFMatrix) for p in parts):
        if all(isinstance(p, GGUFMatrix) for p in parts):
            return block_linear([p for p in parts if isinstance(p, GGUFMatrix)])
        dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
        parts = [p.dequantize(dtype) if isinstance(p, GGUFMatrix) else p for p in parts]
    tensors = [p for p in parts if isinstance(p, torch.Tensor)]
    if len(tensors) == len(parts):
        return torch.cat(tensors).contiguous() if len(tensors) > 1 else tensors[0]
    kind = next(p.kind for p in parts if isinstance(p, QuantizedTensor))
    qs = [p if isinstance(p, QuantizedTensor) else quantize(p, kind) for p in parts
          if not isinstance(p, GGUFMatrix)]
    if len({(p.kind, p.group_size) for p in qs}) > 1:
        qs = [quantize_int8(p.dequantize()) for p in qs]
    return pack(QuantizedTensor.cat(qs))


class WeightTaker:
    """Takes named tensors out of a state dict with a clear error for a missing or misshapen
    one; ``linear`` also quantizes float matrices when asked (``quantize`` int8 / int4)."""

    def __init__(self, state_dict: Mapping[str, StateValue],
                 dtype: torch.dtype, quantize: str | None = None, family: str = "") -> None:
        self.state_dict = state_dict
        self.dtype = dtype
        self.quantize = quantize
        # Named in the missing-tensor error: the family whose layout was expected.
        self.family = family or "Llama-family (Llama, Qwen2, Qwen3, Mistral)"

    def has(self, name: str) -> bool:
        return name in self.state_dict

    def _get(self, name: str, shape: tuple[int, ...]) -> StateValue:
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
        if isinstance(t, GGUFMatrix):
            return t.dequantize(self.dtype)
        if isinstance(t, QuantizedTensor):
            t = t.dequantize()
        return t.to(self.dtype).contiguous()

    def embedding(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | BlockEmbedding:
        """The token embeddings: a GGUF's block matrix as it is, where a kernel reads it."""
        t = self._get(name, shape)
        if isinstance(t, GGUFMatrix) and has_block_kernel(t.fmt):
            return BlockEmbedding(t.weight())
        return self(name, shape)

    def output(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | BlockQuantLinear:
        """An untied output layer: a GGUF's block matrix as it is, where a kernel reads it."""
        t = self._get(name, shape)
        if isinstance(t, GGUFMatrix) and has_block_kernel(t.fmt):
            return block_linear([t])
        return self(name, shape)

    def optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The tensor if the checkpoint has it, else None."""
        return self(name, shape) if self.has(name) else None

    def linear(self, name: str, shape: tuple[int, ...]) -> StateValue:
        """A linear layer's weight: quantized if the checkpoint holds it so or if asked to
        (a GGUF's blocks where a kernel reads their format, else dequantized)."""
        t = self._get(name, shape)
        if isinstance(t, GGUFMatrix):
            return t if has_block_kernel(t.fmt) else t.dequantize(self.dtype)
        if isinstance(t, QuantizedTensor):
            return t
        if self.quantize is not None:
            return quantize(t, self.quantize)  # type: ignore[arg-type]
        return t.to(self.dtype).contiguous()
