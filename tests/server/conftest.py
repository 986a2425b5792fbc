"""Fixtures for the HTTP server tests: the tiny random-weight Llama of tests/fixtures served by
`llmtower serve` in a subprocess, shared by the whole session, and an OpenAI client for it."""
from __future__ import annotations

import pytest

from server_args import MODEL, TINY_SERVER_ARGS, start_server  # noqa: F401
from tests.fixtures.tiny_models import tiny_llama_dir, tiny_tokenizer_dir  # noqa: F401


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory, tiny_llama_dir):
    server = start_server(tmp_path_factory, "tiny_server",
                          ["--model", str(tiny_llama_dir), *TINY_SERVER_ARGS])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(tiny_server):
    import openai
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused",
                         max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def tokenizer(tiny_tokenizer_dir):
    from llmtower.models.tokenizer import load_tokenizer
    return load_tokenizer(tiny_tokenizer_dir)
