"""Fixtures for the engine's client side: the project's tiny tokenizer and models
(tests/fixtures/tiny_models.py), and an LLM over the model-free fake executor."""
from __future__ import annotations

import pytest

from engine_helpers import make_fake_engine_core
from tests.fixtures.tiny_models import tiny_llama_dir, tiny_qwen2_dir, tiny_tokenizer_dir  # noqa: F401


@pytest.fixture(scope="session")
def tokenizer(tiny_tokenizer_dir):
    from llmtower.models.tokenizer import load_tokenizer
    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture
def fake_llm(tokenizer):
    from llmtower.engine.llm import LLM
    return LLM.from_engine_core(make_fake_engine_core(len(tokenizer)), tokenizer)
