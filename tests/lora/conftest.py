"""Fixtures of the LoRA tests: the tiny models and random PEFT adapters of tests/fixtures."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fixtures.lora_adapters import make_peft_adapter
from tests.fixtures.tiny_models import (  # noqa: F401  (pytest finds fixtures by name)
    tiny_llama_dir,
    tiny_qwen2_dir,
    tiny_tokenizer_dir,
)

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_adapters(tmp_path_factory, tiny_llama_dir) -> dict[str, Path]:
    """Three adapters of tiny_llama_dir: every projection (r 8), attention only with rsLoRA
    (r 4), the MLP only (r 16)."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "all": make_peft_adapter(tiny_llama_dir, root / "all", r=8, alpha=16, seed=1),
        "attn": make_peft_adapter(tiny_llama_dir, root / "attn", r=4, alpha=8, seed=2,
                                  targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                                  rslora=True),
        "mlp": make_peft_adapter(tiny_llama_dir, root / "mlp", r=16, alpha=32, seed=3,
                                 targets=["gate_proj", "up_proj", "down_proj"]),
    }
