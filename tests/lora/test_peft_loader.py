"""PEFT folders read and checked against the base model: every refusal names its reason."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from llmtower.lora.adapter import LoRAModelShape
from llmtower.lora.peft_loader import LoRAAdapterError, load_peft_adapter
from llmtower.models.loader import load_model_config
from tests.fixtures.tiny_models import make_tiny_model_dir


def _shape(model_dir):
    return LoRAModelShape.from_config(load_model_config(model_dir))


def test_scaling_folded_into_b(tiny_llama_dir, tiny_adapters):
    from safetensors.torch import load_file

    a = load_peft_adapter(tiny_adapters["attn"], "attn", 1, _shape(tiny_llama_dir),
                          torch.float32, 16)
    assert a.rank == 4 and a.modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert a.scaling == pytest.approx(8 / 2)  # rsLoRA: alpha / sqrt(r)
    raw = load_file(str(tiny_adapters["attn"] / "adapter_model.safetensors"))
    b = raw["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    torch.testing.assert_close(a.b["v_proj"][1], b * 4.0)


def test_rank_above_max_refused(tiny_llama_dir, tiny_adapters):
    with pytest.raises(LoRAAdapterError, match=r"rank 16 is above --max-lora-rank=8"):
        load_peft_adapter(tiny_adapters["mlp"], "mlp", 1, _shape(tiny_llama_dir),
                          torch.float32, 8)


def test_other_base_model_refused(tmp_path_factory, tiny_tokenizer_dir, tiny_adapters):
    other = make_tiny_model_dir(tmp_path_factory, "llama", hidden_size=32,
                                tokenizer_dir=tiny_tokenizer_dir)
    with pytest.raises(LoRAAdapterError, match="trained for another base model"):
        load_peft_adapter(tiny_adapters["all"], "all", 1, _shape(other), torch.float32, 16)


@pytest.mark.parametrize("change, reason", [
    ({"target_modules": ["q_proj", "embed_tokens"]}, "not in this model's adapter-capable"),
    ({"use_dora": True}, "DoRA is not supported"),
    ({"bias": "all"}, "LoRA biases"),
    ({"rank_pattern": {"q_proj": 4}}, "per-module ranks"),
])
def test_unsupported_config_refused(change, reason, tmp_path, tiny_llama_dir, tiny_adapters):
    d = tmp_path / "bad"
    shutil.copytree(tiny_adapters["attn"], d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(change)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoRAAdapterError, match=reason):
        load_peft_adapter(d, "bad", 1, _shape(tiny_llama_dir), torch.float32, 16)


def test_missing_folder_refused(tmp_path, tiny_llama_dir):
    with pytest.raises(LoRAAdapterError, match="is not a directory"):
        load_peft_adapter(tmp_path / "nope", "x", 1, _shape(tiny_llama_dir), torch.float32, 16)
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        load_peft_adapter(tmp_path, "x", 1, _shape(tiny_llama_dir), torch.float32, 16)
