"""The output layer: float32 logits of the final normalized rows, and the greedy screen that
picks most greedy tokens without the full logits."""
from __future__ import annotations

import numpy as np
import torch

from llmtower.kernels import ops
from llmtower.kernels.greedy_head import GreedyHead
from llmtower.models import linear as linear_mod
from llmtower.models.layers.weights import Weight, apply_linear, packed
from llmtower.models.linear import PackedWeight, linear, prepack
from llmtower.models.quant import QuantizedLinear, pack, quantize_int8
from llmtower.models.quant_block import BlockQuantLinear

# Most sampled rows for which the quantized output layer is used (see OutputHead.__init__).
LM_HEAD_QUANTIZED_MAX_ROWS = 12


class OutputHead:
    """Owns the output layer's matrix in the layouts its products take (packed float, or int8
    with a float copy for many rows) and, where it can run, the greedy screen. ``softcap``
    (Gemma 2's ``final_logit_softcapping``) and ``divide_by`` (Granite's ``logits_scaling``)
    are applied to the float32 logits as transformers does."""

    def __init__(self, plain: torch.Tensor | BlockQuantLinear, quantized: bool,
                 softcap: float | None = None, divide_by: float = 1.0) -> None:
        self.softcap = softcap
        self.divide_by = divide_by
        self.dense: torch.Tensor | PackedWeight | None = None
        self.greedy: GreedyHead | None = None
        self.weight: Weight
        if isinstance(plain, BlockQuantLinear):
            self.weight = plain  # the GGUF's own output layer (Q6_K / Q8_0 typically), as it is
            return
        if quantized:
            # The largest matrix, read whole every step: int8 per row (as llama.cpp keeps the
            # output layer at 8 bits or more); the embedding lookup keeps the float table.
            q_head = quantize_int8(plain)
            self.weight = pack(q_head)
            # torch's int8 kernel is a GEMV kernel: past a few rows a float GEMM wins (49152 x
            # 576, measured: int8 2.5x faster at 1 row, even at ~12, 2.6x slower at 64). That
            # GEMM multiplies by the int8 matrix's exact float32 value (7-bit integer times a
            # bfloat16 scale: exact in float32), so a request's logits do not depend on how
            # many others are sampled beside it, up to summation order.
            self.dense = prepack(q_head.q.to(torch.float32)
                                 * q_head.scale.to(QuantizedLinear.COMPUTE_DTYPE).float())
            return
        # Its own packed copy when tied: the embedding lookup reads the plain table.
        self.weight = packed(plain)
        if type(self.weight) is PackedWeight and self.weight.f32:
            # float32: the decode kernel's copy, on huge pages (one stream 1.12x against
            # oneDNN's, docs/performance.md), and the plain matrix for a step that samples
            # more rows than the kernel takes, rather than a third copy (113 MB on SmolLM2).
            self.weight = PackedWeight(plain, self.weight.gemv)
        # Greedy steps pick their tokens from an int8 screen of the output layer and the
        # exact logits of the few rows that could win (kernels/greedy_head.py): the same
        # tokens as the full logits' argmax. Not under a soft cap or a divisor: rounding
        # after them may tie logits the screen tells apart.
        if softcap is None and divide_by == 1.0:
            self.greedy = _greedy_head(plain, self.weight)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of the final normalized rows."""
        if self.dense is not None and x.shape[0] > LM_HEAD_QUANTIZED_MAX_ROWS:
            # What the int8 kernel computes: bfloat16 activations, float32 products and sums,
            # the result rounded to bfloat16.
            cd = QuantizedLinear.COMPUTE_DTYPE
            out = linear(x.to(cd).float(), self.dense).to(cd).float()
        else:
            out = apply_linear(x, self.weight).float()
        if self.divide_by != 1.0:
            out = out / self.divide_by
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def greedy_rows(self) -> int:
        """Most sampled rows ``greedy_tokens`` takes (0: no greedy screen)."""
        g = self.greedy
        if g is None or type(self.weight) is not PackedWeight:
            return 0
        return min(g.max_rows, linear_mod.decode_kernel_rows(self.weight))

    def greedy_tokens(self, hidden: torch.Tensor, allow: np.ndarray | None = None
                      ) -> np.ndarray:
        """The final norm's rows (at most ``greedy_rows()``) -> int64 [rows]: the argmax of
        each row's logits, the first on ties, as the sampler takes it from the full logits
        (``allow``: int32 [rows, ceil(vocab / 32)] grammar bitmasks, the disallowed tokens'
        logits -inf). The greedy screen decides most rows; the full output layer the rest."""
        assert self.greedy is not None
        tokens = self.greedy.tokens(hidden, allow)
        left = np.flatnonzero(tokens < 0)
        if left.size:
            logits = self.logits(hidden[torch.from_numpy(left)]).numpy()
            if allow is not None:
                allowed = np.unpackbits(allow[left].view(np.uint8), axis=1,
                                        bitorder="little")[:, :logits.shape[1]]
                logits[allowed == 0] = -np.inf
            tokens[left] = np.argmax(logits, axis=-1)
        return tokens


def _greedy_head(plain: Weight, head: Weight) -> GreedyHead | None:
    """The output layer's greedy screen, where its products take a decode-step kernel whose
    sums the screen repeats (``kernels/greedy_head.py``); None elsewhere."""
    if type(head) is not PackedWeight or not isinstance(plain, torch.Tensor) \
            or not ops.capabilities().can_run("greedy_head"):
        return None
    kernel = head.gemv
    if kernel.path != 0 or kernel.silu_pair or plain.dtype not in (torch.bfloat16, torch.float32):
        return None
    try:
        return GreedyHead(plain, kernel)
    except ValueError:  # inf or NaN in the weights: the full layer decides every step
        return None
