"""The converted-GGUF cache: convert once, reuse after, never expose a half-written directory."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from llmtower.models import gguf_cache
from llmtower.models.gguf_cache import cached_hf_dir
from llmtower.utils import cache_root
from llmtower.models.loader import load_state_dict, load_model_config, resolve_model_path
from tests.fixtures.tiny_gguf import write_gguf_from_hf_dir


@pytest.fixture()
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "llmtower"


@pytest.fixture()
def tiny_gguf(tmp_path, tiny_llama_dir):
    return write_gguf_from_hf_dir(tiny_llama_dir, tmp_path / "Tiny Llama.gguf")


def count_conversions(monkeypatch) -> list:
    calls: list = []
    real = gguf_cache.write_gguf_model_dir

    def counting(*args):
        calls.append(args)
        real(*args)
    monkeypatch.setattr(gguf_cache, "write_gguf_model_dir", counting)
    return calls


def test_cache_root_follows_xdg(cache_home, monkeypatch):
    assert cache_root() == cache_home
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "llmtower"


def test_gguf_model_converts_once(cache_home, tiny_gguf, monkeypatch):
    calls = count_conversions(monkeypatch)
    first = resolve_model_path(str(tiny_gguf))
    assert first.parent == cache_home and first.name.startswith("Tiny-Llama-")
    # Config, tokenizer and the GGUF's location; no float copy of the weights.
    assert set(os.listdir(first)) == {"config.json", "generation_config.json", "gguf_source.json",
                                      "tokenizer.json", "tokenizer_config.json"}
    assert resolve_model_path(str(tiny_gguf)) == first
    assert len(calls) == 1
    assert load_model_config(first).architecture == "LlamaForCausalLM"
    assert [p.name for p in cache_home.iterdir()] == [first.name]  # no temporary directory left


def test_changed_gguf_gets_a_new_directory(cache_home, tiny_gguf):
    first = cached_hf_dir(tiny_gguf)
    os.utime(tiny_gguf, ns=(1, 1))
    assert cached_hf_dir(tiny_gguf) != first
    with pytest.raises(ValueError, match="changed after"):  # the old one is not read
        load_state_dict(first)


def test_failed_conversion_leaves_nothing(cache_home, tiny_gguf, monkeypatch):
    def half_then_fail(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")
    monkeypatch.setattr(gguf_cache, "write_gguf_model_dir", half_then_fail)
    with pytest.raises(RuntimeError, match="disk full"):
        cached_hf_dir(tiny_gguf)
    assert list(cache_home.iterdir()) == []


def test_concurrent_conversions_agree(cache_home, tiny_gguf, monkeypatch):
    real = gguf_cache.write_gguf_model_dir
    both_converted = threading.Barrier(2, timeout=60)

    def convert_then_wait(*args):
        real(*args)
        both_converted.wait()  # so both renames race for the same final name
    monkeypatch.setattr(gguf_cache, "write_gguf_model_dir", convert_then_wait)
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(cached_hf_dir(tiny_gguf))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert [p.name for p in cache_home.iterdir()] == [results[0].name]
    assert load_model_config(results[0]).vocab_size == 512


def test_unwritable_cache(tmp_path, tiny_gguf, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with pytest.raises(OSError, match="set XDG_CACHE_HOME to a writable directory"):
        cached_hf_dir(tiny_gguf)
