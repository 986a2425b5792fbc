"""ModelConfig.from_hf_config: both config.json layouts (transformers v4 and v5), RoPE scaling,
EOS ids, and clear errors for what llmtower cannot run."""
from __future__ import annotations

import json

import pytest

from llmtower.models.config import ModelConfig

LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def write_config(tmp_path, **overrides):
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "eos_token_id": 2}
    cfg.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not ...}))
    return tmp_path


def test_defaults_fill_head_dim_and_kv_heads(tmp_path):
    config = ModelConfig.from_hf_config(write_config(tmp_path))
    assert (config.head_dim, config.num_key_value_heads, config.num_queries_per_kv) == (16, 4, 1)
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert not config.tie_word_embeddings and config.sliding_window is None


def test_explicit_head_dim_wins(tmp_path):
    config = ModelConfig.from_hf_config(write_config(tmp_path, head_dim=32, num_key_value_heads=2))
    assert (config.head_dim, config.num_key_value_heads) == (32, 2)


def test_legacy_rope_keys(tmp_path):
    config = ModelConfig.from_hf_config(write_config(
        tmp_path, rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3_ROPE}))
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "llama3", **LLAMA3_ROPE}


def test_transformers_v5_rope_parameters(tmp_path):
    config = ModelConfig.from_hf_config(write_config(
        tmp_path, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_ROPE}))
    assert config.rope_theta == 500000.0 and config.rope_scaling["rope_type"] == "llama3"
    assert config.rope_scaling["original_max_position_embeddings"] == 8192


def test_default_rope_type_means_no_scaling(tmp_path):
    config = ModelConfig.from_hf_config(write_config(
        tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert config.rope_scaling is None and config.rope_theta == 1e6


def test_llama3_rope_scaling_from_fixture(tmp_path_factory, tiny_tokenizer_dir):
    from tests.fixtures.tiny_models import make_tiny_model_dir

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    path = make_tiny_model_dir(tmp_path_factory, "llama", rope_scaling=scaling, rope_theta=500000.0,
                               tokenizer_dir=tiny_tokenizer_dir)
    config = ModelConfig.from_hf_config(path)
    assert config.rope_scaling == scaling and config.rope_theta == 500000.0


def test_unsupported_rope_type(tmp_path):
    with pytest.raises(ValueError, match="'longrope' is not supported.*default, llama3, linear"):
        ModelConfig.from_hf_config(write_config(tmp_path, rope_scaling={
            "type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}))


def test_incomplete_llama3_rope(tmp_path):
    with pytest.raises(ValueError, match="lacks low_freq_factor"):
        ModelConfig.from_hf_config(write_config(
            tmp_path, rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}))


def test_eos_ids_merge_generation_config(tmp_path):
    write_config(tmp_path, eos_token_id=[2, 7])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert ModelConfig.from_hf_config(tmp_path).eos_token_ids == [2, 7, 9]


def test_qwen2_always_has_attention_bias(tmp_path):
    config = ModelConfig.from_hf_config(write_config(tmp_path, architectures=["Qwen2ForCausalLM"]))
    assert config.attention_bias


def test_architecture_from_model_type(tmp_path):
    config = ModelConfig.from_hf_config(write_config(tmp_path, architectures=..., model_type="mistral",
                                                     sliding_window=4096))
    assert config.architecture == "MistralForCausalLM" and config.sliding_window == 4096


@pytest.mark.parametrize("overrides, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["sliding_attention"]}, "layer_types has 1 entries"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["sliding_attention", "chunked_attention"]}, "'chunked_attention'"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": -4}, "sliding_window=-4"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"vocab_size": ...}, "lacks the required key 'vocab_size'"),
])
def test_bad_configs(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(write_config(tmp_path, **overrides))


def test_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_hf_config(tmp_path)


def test_to_hf_dict_round_trips(tmp_path):
    config = ModelConfig("Qwen2ForCausalLM", 100, 64, 128, 2, 4, 2, rope_theta=1e6, eos_token_ids=[3, 4],
                         tie_word_embeddings=True, attention_bias=True, bos_token_id=None)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    assert ModelConfig.from_hf_config(tmp_path) == config


def _windows(tmp_path, **cfg) -> list[int | None]:
    return ModelConfig.from_hf_config(write_config(tmp_path, **cfg)).layer_sliding_windows()


def test_layer_sliding_windows_follow_transformers(tmp_path):
    """Which layers are windowed, as each family's transformers config decides it."""
    n = {"num_hidden_layers": 4}
    assert _windows(tmp_path, architectures=["LlamaForCausalLM"], sliding_window=8,
                    **n) == [None] * 4
    assert _windows(tmp_path, architectures=["MistralForCausalLM"], sliding_window=16,
                    **n) == [16] * 4
    assert _windows(tmp_path, architectures=["MistralForCausalLM"], sliding_window=None,
                    **n) == [None] * 4
    assert _windows(tmp_path, architectures=["Phi3ForCausalLM"], sliding_window=8, **n) == [8] * 4
    # Qwen2: a window only with use_sliding_window, and only from layer max_window_layers on.
    qwen = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 8, **n}
    assert _windows(tmp_path, **qwen) == [None] * 4
    assert _windows(tmp_path, use_sliding_window=True, max_window_layers=1,
                    **qwen) == [None, 8, 8, 8]
    assert _windows(tmp_path, use_sliding_window=True, layer_types=[
        "full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        **qwen) == [None, 8, None, 8]


def test_alternating_window_patterns():
    """Gemma 2 / gpt-oss: every other layer global; Gemma 3: every sixth (or
    sliding_window_pattern); Qwen2-MoE: odd layers below max_window_layers."""
    from llmtower.models.config import hf_sliding_windows

    def types(cfg):
        w, t = hf_sliding_windows({"num_hidden_layers": 6, "sliding_window": 4, **cfg}, "")
        return "".join("S" if x == "sliding_attention" else "F" for x in t)

    assert types({"model_type": "gemma2"}) == "SFSFSF"
    assert types({"model_type": "gpt_oss"}) == "SFSFSF"
    assert types({"model_type": "gemma3_text"}) == "SSSSSF"
    assert types({"model_type": "gemma3_text", "sliding_window_pattern": 3}) == "SSFSSF"
    assert types({"model_type": "qwen2_moe", "use_sliding_window": True,
                  "max_window_layers": 4}) == "SFSFFF"


def test_windowed_config_round_trips(tmp_path):
    config = ModelConfig("Qwen2ForCausalLM", 100, 64, 128, 3, 4, 2, attention_bias=True,
                         sliding_window=8, layer_types=["full_attention", "sliding_attention",
                                                        "sliding_attention"])
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    assert ModelConfig.from_hf_config(tmp_path) == config
    assert config.layer_sliding_windows() == [None, 8, 8] and not config.all_layers_windowed
