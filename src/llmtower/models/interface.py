"""What the model runner needs of a model: the protocol every family's class follows."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch

from llmtower.lora.punica import LoRAStep
from llmtower.models.attention import AttentionMetadata, PagedAttention
from llmtower.models.config import ModelConfig
from llmtower.models.layers.weights import StateValue


class CausalLM(Protocol):
    """A decoder-only language model over a step's flat batch of tokens and its paged cache.

    Constructed as ``cls(config, state_dict, dtype, max_position, quantization)``;
    ``supports_lora`` says whether ``forward`` takes adapter rows (``lora``)."""

    config: ModelConfig
    dtype: torch.dtype
    supports_lora: bool

    def __init__(self, config: ModelConfig,
                 state_dict: Mapping[str, StateValue],
                 dtype: torch.dtype, max_position: int, quantization: str = "none") -> None: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn: PagedAttention, meta: AttentionMetadata,
                logits_indices: torch.Tensor, head: bool = True,
                lora: LoRAStep | None = None) -> torch.Tensor:
        """input_ids/positions [T] -> float32 logits [len(logits_indices), vocab] (``head``
        False: the final norm's rows, for ``greedy_tokens``)."""
        ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], attn: PagedAttention, meta: AttentionMetadata,
                 logits_indices: torch.Tensor, head: bool = True,
                 lora: LoRAStep | None = None) -> torch.Tensor: ...

    def greedy_rows(self) -> int:
        """Most sampled rows ``greedy_tokens`` takes (0: none)."""
        ...

    def greedy_tokens(self, hidden: torch.Tensor, allow: np.ndarray | None = None) -> np.ndarray:
        """The argmax token of each final-norm row, as the sampler would pick it."""
        ...
