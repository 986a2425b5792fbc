"""`llmtower generate` and `llmtower chat` in a subprocess, on a tiny random-weight model."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fixtures.tiny_models import tiny_llama_dir, tiny_tokenizer_dir  # noqa: F401

ENGINE_FLAGS = ["--num-threads", "1", "--max-model-len", "128", "--kv-cache-memory", "8MiB"]


def llmtower(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmtower.cli.main", *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_generate_help_lists_sampling_and_engine_flags():
    r = llmtower("generate", "--help")
    assert r.returncode == 0
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--stop",
                 "--chat", "--model", "--kv-cache-memory"):
        assert flag in r.stdout


def test_generate_bad_model_is_a_clear_error(tmp_path):
    r = llmtower("generate", "--model", str(tmp_path / "nope"), "hi")
    assert r.returncode != 0 and "not found" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture
def needs_factory():
    pytest.importorskip("llmtower.engine.factory",
                        reason="llmtower.engine.factory.create_engine_core is not built yet")


def test_generate_prints_the_completion(needs_factory, tiny_llama_dir):
    r = llmtower("generate", "--model", str(tiny_llama_dir), "--max-tokens", "8",
                 "--temperature", "0", "--ignore-eos", *ENGINE_FLAGS, "Hello world")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "8 tokens" in r.stderr and "finish_reason=length" in r.stderr


def test_chat_keeps_going_until_exit(needs_factory, tiny_llama_dir):
    r = llmtower("chat", "--model", str(tiny_llama_dir), "--max-tokens", "6",
                 "--temperature", "0", *ENGINE_FLAGS, stdin="Hello\nHow are you?\n/exit\nignored\n")
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stdout.splitlines() if line.strip()]) >= 2
