"""Fixtures of the executor tests: the tiny random-weight models of tests/fixtures/tiny_models.py."""
from __future__ import annotations

import torch

from tests.fixtures.tiny_models import (  # noqa: F401  (pytest finds fixtures by name)
    tiny_llama_dir,
    tiny_qwen2_dir,
    tiny_tokenizer_dir,
)

# Tiny models gain nothing from a second thread, and when other jobs share the two cores an
# OpenMP pair spinning at barriers runs ten times slower than one thread.
torch.set_num_threads(1)
