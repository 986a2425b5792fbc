"""Synthetic random-weight models for benchmarks, addressed by name (``--model w1``).

A synthetic model is built with transformers from a fixed seed and saved once as a Hugging
Face directory under ``$XDG_CACHE_HOME/llmtower/synthetic/``, so llmtower and transformers load
the very same weights and later runs start at once.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

# W1, the reference throughput workload's model: a small Llama, float32, random weights.
SYNTHETIC_MODELS: dict[str, dict] = {
    "w1": dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12,
               num_key_value_heads=12, intermediate_size=2048, vocab_size=16384,
               max_position_embeddings=2048, rms_norm_eps=1e-5),
}


def is_synthetic_model(name: str | None) -> bool:
    return name is not None and name.lower() in SYNTHETIC_MODELS


def synthetic_model_dir(name: str, seed: int = 0) -> Path:
    """The directory of synthetic model ``name`` built with ``seed`` (built on first use)."""
    key = name.lower()
    if key not in SYNTHETIC_MODELS:
        raise ValueError(f"unknown synthetic model {name!r}: use one of {', '.join(SYNTHETIC_MODELS)}")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    out = cache / "llmtower" / "synthetic" / f"{key}-seed{seed}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SYNTHETIC_MODELS[key], bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, tie_word_embeddings=False, dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float().eval()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(str(tmp), safe_serialization=True)
    if out.exists():  # an incomplete earlier build
        shutil.rmtree(out)
    tmp.rename(out)
    return out
