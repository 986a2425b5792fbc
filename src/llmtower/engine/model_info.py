"""ModelInfo: what an EngineCore knows about the model it runs, for its front ends."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmtower.models.config import ModelConfig


@dataclass(frozen=True)
class ModelInfo:
    """Owns the facts about the loaded model that the front ends (``LLM``, the engine process's
    handshake, the benchmarks) read: where it came from, its limits and its EOS ids."""

    model_config: ModelConfig
    model_path: Path
    max_model_len: int
    dtype: torch.dtype = torch.float32
    num_threads: int = 1
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size
