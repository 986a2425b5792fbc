"""Fixtures of the speculative-decoding tests: the tiny random-weight models."""
from __future__ import annotations

import torch

from tests.fixtures.tiny_models import (  # noqa: F401  (pytest finds fixtures by name)
    tiny_llama_dir,
    tiny_qwen2_dir,
    tiny_tokenizer_dir,
)

torch.set_num_threads(1)  # tiny models gain nothing from a second thread
