"""Fixtures for structured outputs: the project's tiny tokenizer and random-weight model."""
from __future__ import annotations

import pytest

from tests.fixtures.tiny_models import tiny_llama_dir, tiny_tokenizer_dir  # noqa: F401


@pytest.fixture(scope="session")
def tokenizer(tiny_tokenizer_dir):
    from llmtower.models.tokenizer import load_tokenizer
    return load_tokenizer(tiny_tokenizer_dir)
