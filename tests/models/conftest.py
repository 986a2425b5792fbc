"""Fixtures of the model-loading tests: the tiny models of tests/fixtures/tiny_models.py."""
from __future__ import annotations

import torch

from tests.fixtures.tiny_models import (  # noqa: F401  (pytest finds fixtures by name)
    tiny_llama_dir,
    tiny_mistral_dir,
    tiny_qwen2_dir,
    tiny_tokenizer_dir,
)

# Two cores: more threads than that only oversubscribes.
torch.set_num_threads(2)
