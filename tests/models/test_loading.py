"""The public entry points on Hugging Face directories: resolve a --model value, load its
config, weights (as transformers saved them) and tokenizer, and fail clearly on bad input."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from llmtower.models.loader import load_model_config, load_state_dict, load_tokenizer, resolve_model_path
from tests.fixtures.tiny_models import IM_END_ID, IM_START_ID, TINY_VOCAB_SIZE, make_tiny_model_dir


def saved_tensors(model_dir) -> dict[str, torch.Tensor]:
    """What transformers' save_pretrained wrote, read without llmtower."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def tiny_llama_tied_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_tiny_model_dir(tmp_path_factory, "llama", tie=True, tokenizer_dir=tiny_tokenizer_dir)


def test_untied_llama_loads_as_saved(tiny_llama_dir):
    path = resolve_model_path(str(tiny_llama_dir))
    assert path == tiny_llama_dir.resolve()
    config = load_model_config(path)
    assert (config.architecture, config.vocab_size, config.hidden_size) == ("LlamaForCausalLM", TINY_VOCAB_SIZE, 64)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert not config.tie_word_embeddings and not config.attention_bias
    assert config.eos_token_ids == [IM_END_ID] and config.bos_token_id == IM_START_ID
    state = load_state_dict(path, torch.float32)
    expected = saved_tensors(tiny_llama_dir)
    assert state.keys() == expected.keys()
    assert "lm_head.weight" in state
    assert state["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    for name, tensor in expected.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], tensor), name


def test_tied_llama_has_no_lm_head(tiny_llama_tied_dir):
    config = load_model_config(tiny_llama_tied_dir)
    state = load_state_dict(tiny_llama_tied_dir, "float32")
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in state
    assert torch.equal(state["model.embed_tokens.weight"],
                       saved_tensors(tiny_llama_tied_dir)["model.embed_tokens.weight"])


def test_qwen2_has_qkv_biases(tiny_qwen2_dir):
    config = load_model_config(tiny_qwen2_dir)
    state = load_state_dict(tiny_qwen2_dir)
    assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.0.self_attn.{proj}.bias" in state
    assert "model.layers.0.self_attn.o_proj.bias" not in state
    expected = saved_tensors(tiny_qwen2_dir)
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], v) for k, v in expected.items())


def test_mistral_loads(tiny_mistral_dir):
    config = load_model_config(tiny_mistral_dir)
    assert config.architecture == "MistralForCausalLM" and config.sliding_window is None
    assert load_state_dict(tiny_mistral_dir).keys() == saved_tensors(tiny_mistral_dir).keys()


def test_bfloat16_cast(tiny_llama_dir):
    state = load_state_dict(tiny_llama_dir, torch.bfloat16)
    expected = saved_tensors(tiny_llama_dir)
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    assert torch.equal(state["model.norm.weight"], expected["model.norm.weight"].to(torch.bfloat16))


def test_sharded_checkpoint_loads_every_shard(tmp_path_factory, tiny_tokenizer_dir):
    sharded = make_tiny_model_dir(tmp_path_factory, "llama", tokenizer_dir=tiny_tokenizer_dir,
                                  max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    state = load_state_dict(sharded)
    expected = saved_tensors(sharded)
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], v) for k, v in expected.items())

    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[0]
    (sharded / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing):
        load_state_dict(sharded)


def test_tokenizer_round_trips_and_applies_chat_template(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)
    text = "What is the capital of France? Paris, 2024."
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>") == [IM_START_ID]
    assert tok.eos_token_id == IM_END_ID
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == IM_START_ID and ids.count(IM_END_ID) == 1


def test_config_json_path_resolves_to_its_directory(tiny_llama_dir):
    assert resolve_model_path(str(tiny_llama_dir / "config.json")) == tiny_llama_dir.resolve()


def test_unknown_model_is_not_downloaded():
    with pytest.raises(FileNotFoundError, match="never downloads"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_directory_without_config(tmp_path):
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"config\.json not found in .*model\.Q4_0\.gguf"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"config.json not found in {tmp_path}"):
        load_model_config(tmp_path)


def test_file_that_is_not_gguf(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model_path(str(weights))


def test_missing_weights(tmp_path, tiny_llama_dir):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=rf"no model weights in {tmp_path}.*safe_serialization"):
        load_state_dict(tmp_path)


def test_untied_config_without_lm_head(tmp_path, tiny_llama_tied_dir):
    shutil.copytree(tiny_llama_tied_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no lm_head.weight"):
        load_state_dict(tmp_path / "m")


def test_unsupported_architecture(tmp_path, tiny_llama_dir):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, Phi3ForCausalLM"):
        load_model_config(tmp_path)


def test_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no tokenizer in {tmp_path}"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("where", ["rope_parameters", "top_level"])
def test_phi3_partial_rotary_is_refused_by_name(tmp_path, tiny_llama_dir, where):
    """Phi-4-mini rotates 3/4 of each head: refused, not run with the wrong positions."""
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config["architectures"] = ["Phi3ForCausalLM"]
    config.pop("rope_scaling", None)
    if where == "rope_parameters":
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.75}
    else:
        config.pop("rope_parameters", None)
        config["partial_rotary_factor"] = 0.75
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="partial_rotary_factor=0.75"):
        load_model_config(tmp_path)
