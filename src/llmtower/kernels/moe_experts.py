"""Python side of the mixture-of-experts decode kernel (``moe_experts.c``): ``MoEExperts`` owns a
layer's tables of its experts' packed matrices and runs a few tokens' chosen experts in one call.

The experts' matrices stay where their per-expert products keep them (``GemvWeight`` for
bfloat16, ``GemmF32Weight`` for float32, gate and up as a silu pair): the tables hold their
addresses, and the object keeps the weights alive. The kernel computes what the per-expert path
computes (silu_mul, down, weighted sum in ascending expert order), bit for bit. Given the
router matrix it also routes (softmax, top k, optional renormalization) in the same call
(``routed``): a decode step's whole MoE block but a shared expert, one call per layer. Callers
check ``ops.capabilities().can_run("moe_experts_bf16" / "moe_experts_f32")`` first.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from llmtower.kernels.gemm_f32 import GemmF32Weight
from llmtower.kernels.gemv_bf16 import GemvWeight
from llmtower.kernels.ops import kernel_library

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# The most experts per token the kernel takes (moe_experts.c's MOE_MAX_K), and the most experts
# its routing takes (MOE_MAX_E).
MAX_ACTIVE = 64
MAX_ROUTED_EXPERTS = 1024


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = kernel_library()
    # x, tokens, ldx, gate_up table, down table, experts, ids, weights, k, hidden, inter,
    # router, normalize, h scratch, (f32: y scratch,) out, threads, path
    lib.moe_experts_bf16.argtypes = [_P, _I64, _I64, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _P,
                                     _INT, _P, _P, _INT, _INT]
    lib.moe_experts_f32.argtypes = [_P, _I64, _I64, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _P,
                                    _INT, _P, _P, _P, _INT, _INT]
    lib.moe_experts_bf16.restype = lib.moe_experts_f32.restype = _INT
    return lib


class MoEExperts:
    """Owns the address tables of one layer's experts (gate/up silu pairs and down matrices, in
    one decode-step kernel's layout), and for ``routed`` the router matrix [E, hidden] and
    whether the top k are renormalized; ``path=1`` runs the portable C code (tests compare)."""

    def __init__(self, gate_up: Sequence[GemvWeight | GemmF32Weight],
                 down: Sequence[GemvWeight | GemmF32Weight], router: torch.Tensor | None = None,
                 normalize: bool = True, path: int = 0) -> None:
        if not gate_up or len(gate_up) != len(down):
            raise ValueError("moe_experts: one gate/up pair and one down matrix per expert")
        kind = type(gate_up[0])
        self.f32 = kind is GemmF32Weight
        self.dtype = torch.float32 if self.f32 else torch.bfloat16
        self.inter, self.hidden = gate_up[0].n, gate_up[0].k
        for g, d in zip(gate_up, down, strict=True):
            if type(g) is not kind or type(d) is not kind or not g.silu_pair or d.silu_pair \
                    or (g.n, g.k, d.n, d.k) != (self.inter, self.hidden, self.hidden, self.inter):
                raise ValueError("moe_experts: every expert needs a gate/up silu pair "
                                 f"[{self.inter}, {self.hidden}] and a down matrix "
                                 f"[{self.hidden}, {self.inter}] of one kind")
        self.num_experts = len(gate_up)
        self.path = path
        if router is not None and (router.dtype != self.dtype or router.shape != (
                self.num_experts, self.hidden) or self.num_experts > MAX_ROUTED_EXPERTS):
            raise ValueError(f"moe_experts: the router must be {self.dtype} "
                             f"[{self.num_experts}, {self.hidden}] with at most "
                             f"{MAX_ROUTED_EXPERTS} experts")
        self.router = None if router is None else router.contiguous()
        self.normalize = normalize
        self._weights = (list(gate_up), list(down))  # what the tables point into
        self._gate_up = torch.tensor([w.packed.data_ptr() for w in gate_up], dtype=torch.int64)
        self._down = torch.tensor([w.packed.data_ptr() for w in down], dtype=torch.int64)
        self._lib = _lib()

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for x [T, hidden] in the weights'
        dtype, ids [T, k] int64, weights [T, k] float32: [T, hidden]."""
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.hidden \
                or x.stride(1) != 1:
            raise ValueError(f"moe_experts: x must be {self.dtype} [T, {self.hidden}] with unit "
                             f"column stride, not {x.dtype} {tuple(x.shape)}")
        t = x.shape[0]
        if ids.dtype != torch.int64 or weights.dtype != torch.float32 or ids.dim() != 2 \
                or ids.shape[0] != t or ids.shape != weights.shape:
            raise ValueError("moe_experts: ids must be int64 and weights float32, both [T, k]")
        return self._run(x, ids.contiguous(), weights.contiguous(), None)

    def routed(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """The block's routed output for x [T, hidden]: each row's top ``k`` experts by the
        router's softmax, weighted (renormalized if ``normalize``) and summed."""
        if self.router is None:
            raise TypeError("moe_experts: this block was built without its router")
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.hidden \
                or x.stride(1) != 1:
            raise ValueError(f"moe_experts: x must be {self.dtype} [T, {self.hidden}] with unit "
                             f"column stride, not {x.dtype} {tuple(x.shape)}")
        t = x.shape[0]
        ids = torch.empty(t, k, dtype=torch.int64)
        weights = torch.empty(t, k, dtype=torch.float32)
        return self._run(x, ids, weights, self.router)

    def _run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             router: torch.Tensor | None) -> torch.Tensor:
        t, k = ids.shape
        out = x.new_empty(t, self.hidden)
        h = x.new_empty(k, self.inter)
        ldx = x.stride(0) if t > 1 else self.hidden
        args = (x.data_ptr(), t, ldx, self._gate_up.data_ptr(), self._down.data_ptr(),
                self.num_experts, ids.data_ptr(), weights.data_ptr(), k, self.hidden,
                self.inter, None if router is None else router.data_ptr(),
                int(self.normalize), h.data_ptr())
        threads = torch.get_num_threads()
        if self.f32:
            y = x.new_empty(k, self.hidden)
            rc = self._lib.moe_experts_f32(*args, y.data_ptr(), out.data_ptr(), threads,
                                           self.path)
        else:
            rc = self._lib.moe_experts_bf16(*args, out.data_ptr(), threads, self.path)
        if rc:
            raise ValueError(f"moe_experts: expert ids must lie in [0, {self.num_experts}) and "
                             f"k in [1, {MAX_ACTIVE}] (got k={k})")
        return out
