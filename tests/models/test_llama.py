"""The Llama-family model against transformers: same weights, same logits, same rotations."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmtower.executor.kv_cache import KVCache
from llmtower.models.attention import AttentionMetadata, PagedAttention, PrefillSeq
from llmtower.models.llama import LlamaForCausalLM
from llmtower.models.loader import load_model_config, load_state_dict
from llmtower.models.layers.rotary import RotaryEmbedding
from tests.fixtures.tiny_models import make_tiny_model_dir

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
IDS = [5, 77, 300, 12, 9, 450, 33, 1, 2, 101, 222, 333, 444, 17, 64, 128, 256, 511, 3, 4] * 6


def our_logits(model_dir: Path, ids: list[int], dtype=torch.float32) -> torch.Tensor:
    """Logits of every position of one prompt, prefilled in one step."""
    cfg = load_model_config(model_dir)
    model = LlamaForCausalLM(cfg, load_state_dict(model_dir, dtype), dtype, max_position=256)
    block_size, n = 4, len(ids)
    kv = KVCache(cfg, num_blocks=64, num_cpu_blocks=0, block_size=block_size, dtype=dtype)
    attn = PagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                          block_size, dtype, gather_buffer_blocks=64)
    meta = AttentionMetadata(n, torch.arange(n), prefills=[PrefillSeq(0, n, 0)])
    return model(torch.tensor(ids), torch.arange(n), kv.kv_caches, attn, meta, torch.arange(n))


def hf_logits(model_dir: Path, ids: list[int], dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("variant", ["llama", "qwen2", "mistral", "llama_tied_mha", "llama3_rope"])
def test_logits_match_transformers(variant, tmp_path_factory, tiny_tokenizer_dir, tiny_llama_dir,
                                   tiny_qwen2_dir, tiny_mistral_dir):
    model_dir = {
        "llama": lambda: tiny_llama_dir,
        "qwen2": lambda: tiny_qwen2_dir,
        "mistral": lambda: tiny_mistral_dir,
        "llama_tied_mha": lambda: make_tiny_model_dir(
            tmp_path_factory, "llama", tie=True, num_kv_heads=4, tokenizer_dir=tiny_tokenizer_dir),
        "llama3_rope": lambda: make_tiny_model_dir(
            tmp_path_factory, "llama", rope_scaling=LLAMA3_SCALING, tokenizer_dir=tiny_tokenizer_dir),
    }[variant]()
    ours, ref = our_logits(model_dir, IDS), hf_logits(model_dir, IDS)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-5)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_qwen2_biases_are_used(tiny_qwen2_dir):
    state = load_state_dict(tiny_qwen2_dir)
    assert "model.layers.0.self_attn.q_proj.bias" in state
    cfg = load_model_config(tiny_qwen2_dir)
    model = LlamaForCausalLM(cfg, state, torch.float32, max_position=64)
    assert model.layers[0].qkv_bias is not None and model.layers[0].o_bias is None


def test_bfloat16_logits_stay_close_to_float32(tiny_llama_dir):
    ours = our_logits(tiny_llama_dir, IDS, torch.bfloat16)
    ref = our_logits(tiny_llama_dir, IDS, torch.float32)
    assert ours.dtype == torch.float32  # logits are always handed to the sampler in float32
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING])
def test_rotary_tables_are_bit_identical_to_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 10000.0, **(scaling or {})}
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=512,
                      rope_parameters=rope)
    hf_cos, hf_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1), torch.arange(300)[None])
    ours = RotaryEmbedding(64, 300, 10000.0, scaling, torch.float32)
    assert torch.equal(torch.cat([ours.cos, ours.cos], -1), hf_cos[0])
    assert torch.equal(torch.cat([ours.sin, ours.sin], -1), hf_sin[0])


def test_missing_or_misshapen_tensor_is_a_clear_error(tiny_llama_dir):
    cfg = load_model_config(tiny_llama_dir)
    state = load_state_dict(tiny_llama_dir)
    broken = dict(state)
    del broken["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        LlamaForCausalLM(cfg, broken, torch.float32, max_position=64)
    broken = dict(state)
    broken["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        LlamaForCausalLM(cfg, broken, torch.float32, max_position=64)


def test_onednn_and_plain_matrix_products_agree():
    from llmtower.models import linear as ops

    torch.manual_seed(0)
    x, w, g, b = torch.randn(7, 64), torch.randn(96, 64), torch.randn(96, 64), torch.randn(96)
    torch.testing.assert_close(ops.linear(x, w, b), ops._plain_linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.silu_mul(x, g, w), ops._plain_silu_mul(x, g, w), rtol=1e-5, atol=1e-4)
