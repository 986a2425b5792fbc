"""The model's matrix products on CPU: oneDNN where this torch has it, plain torch otherwise.

oneDNN's matmul (the op ``torch.compile`` emits for CPU linears) runs W1's decode shapes (64
rows, weights not in cache) at ~160 GFLOPS where ``F.linear``'s MKL path gets ~110, and is no
slower on large batches. It can also apply SiLU to its output and multiply by another tensor
inside the GEMM, which saves the MLP two passes over its largest activation. Both paths compute
in full float32 (or bfloat16 with float32 accumulation); they differ only in summation order.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Linear = Callable[..., torch.Tensor]


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _plain_silu_mul(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(F.linear(x, gate)).mul_(F.linear(x, up))


def _onednn_ops() -> tuple[Linear, Callable[..., torch.Tensor]] | None:
    try:
        op = torch.ops.mkldnn._linear_pointwise
        if not torch.backends.mkldnn.is_available():
            return None
        x, w = torch.ones(2, 4), torch.full((3, 4), 0.5)
        if not torch.allclose(op(x, w, None, "none", [], ""), F.linear(x, w)):
            return None
        if not torch.allclose(op.binary(x, op(x, w, None, "swish", [], ""), w, None, "mul"),
                              _plain_silu_mul(x, w, w)):
            return None
    except (AttributeError, RuntimeError):
        return None

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return op(x, weight, bias, "none", [], "")

    def silu_mul(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return op.binary(x, op(x, gate, None, "swish", [], ""), up, None, "mul")

    return linear, silu_mul


_ops = _onednn_ops()
USING_ONEDNN = _ops is not None
# linear(x, weight, bias=None) = x @ weight.T + bias
linear: Linear = _ops[0] if _ops else _plain_linear
# silu_mul(x, gate, up) = silu(x @ gate.T) * (x @ up.T), the SwiGLU MLP's first half
silu_mul: Callable[..., torch.Tensor] = _ops[1] if _ops else _plain_silu_mul
