"""The model families on the shared layers (models/decoder.py and its subclasses): each, built
tiny and random with transformers (hidden 64, 2 layers, norms perturbed away from their
initial values so that a wrong norm formula shows), gives transformers' greedy tokens in
float32 through a real EngineCore with chunked prefill and prefix caching; and the registry
refuses what it does not load by name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from llmtower.models.registry import check_architecture, model_class, supported_architectures
from tests.executor.exactness_helpers import (add_greedy, hf_greedy, make_engine, random_prompts,
                                              run_all)
from tests.fixtures.tiny_models import TOKENIZER_FILES

MAX_TOKENS = 6
PROMPTS = random_prompts(4, 5, 40, seed=21)
SHARED = random_prompts(1, 8, 8, seed=22)[0]  # two blocks of 4, cached after the first
PREFIXED = random_prompts(2, 2, 5, seed=23, prefix=SHARED)
CHUNKED = dict(max_num_batched_tokens=16, long_prefill_token_threshold=8,
               max_num_partial_prefills=2, max_model_len=64)
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)
MOE = dict(num_experts_per_tok=2, intermediate_size=48)

# family -> (transformers config class, model class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Scale from query_pre_attn_scalar (32, not head_dim), a soft cap that bites, GeGLU.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        query_pre_attn_scalar=32, attn_logit_softcapping=0.5, final_logit_softcapping=3.0,
        sliding_window=16, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        query_pre_attn_scalar=32, sliding_window=16, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000000.0}})),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.1,
        logits_scaling=8.0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # Three windowed layers of four (16 tokens), YaRN on the global layer only.
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        num_hidden_layers=4, sliding_window=16,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 32,
                                            "rope_theta": 10000.0}})),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, **MOE)),
    # Layer 1 dense (mlp_only_layers), a shared expert with its sigmoid gate, q/k/v biases.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=40,
        mlp_only_layers=[1], **MOE)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, **MOE)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, clip_qkv=0.3, **MOE)),
    # Sinks, biases everywhere, YaRN, a clamp limit the activations reach.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_local_experts=4, sliding_window=16, swiglu_limit=0.5, **MOE,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 32,
                         "rope_theta": 150000.0})),
}


def _build(out: Path, tokenizer_dir: Path, name: str) -> Path:
    import transformers

    cfg_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**{**BASE, "initializer_range": 0.1, **extra})
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / f, out / f)
    return out


def _generate(path: Path) -> list[list[int]]:
    core = make_engine(path, **CHUNKED)
    add_greedy(core, PROMPTS, MAX_TOKENS)
    out = run_all(core)
    got = [out[str(i)] for i in range(len(PROMPTS))]
    first = len(PROMPTS)
    add_greedy(core, PREFIXED[:1], MAX_TOKENS, first_id=first)
    got.append(run_all(core)[str(first)])
    add_greedy(core, PREFIXED[1:], MAX_TOKENS, first_id=first + 1)
    got.append(run_all(core)[str(first + 1)])
    assert core.scheduler.kv.prefix_cache_hits >= len(SHARED)
    return got


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_tokenizer_dir):
    """family -> its model directory, built once for the module's tests."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = _build(tmp_path_factory.mktemp(family), tiny_tokenizer_dir, family)
        return cache[family]
    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float32_greedy_equals_transformers(family, built):
    path = built(family)
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    assert model_class(arch).__name__ == arch  # its own class, not the Llama one
    assert _generate(path) == hf_greedy(path, PROMPTS + PREFIXED, MAX_TOKENS)


def test_every_registered_architecture_has_its_class():
    for arch in supported_architectures():
        assert callable(model_class(arch))


@pytest.mark.parametrize("arch, why", [
    ("LlavaForConditionalGeneration", "multimodal"),
    ("JambaForCausalLM", "hybrid"),
    ("BertForMaskedLM", "encoder"),
    ("GPT2LMHeadModel", ""),
])
def test_unsupported_architectures_are_refused_by_name(arch, why):
    with pytest.raises(ValueError, match=f"unsupported architecture '{arch}'.*{why}.*"
                                         "Gemma2ForCausalLM.*OlmoeForCausalLM"):
        check_architecture(arch)


IDS = random_prompts(1, 100, 100, seed=24)[0]  # longer than the windows (16)


def _our_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt, prefilled in one step (no engine: no
    max_model_len cap, so the prompt may pass the sliding windows)."""
    from llmtower.executor.kv_cache import KVCache
    from llmtower.models.attention import AttentionMetadata, PagedAttention, PrefillSeq
    from llmtower.models.loader import load_model_config, load_state_dict

    cfg = load_model_config(path)
    model = model_class(cfg.architecture)(cfg, load_state_dict(path), torch.float32, 128)
    n = len(ids)
    kv = KVCache(cfg, num_blocks=64, num_cpu_blocks=0, block_size=4, dtype=torch.float32)
    attn = PagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 4,
                          torch.float32, gather_buffer_blocks=64)
    meta = AttentionMetadata(n, torch.arange(n), prefills=[PrefillSeq(0, n, 0)])
    return model(torch.tensor(ids), torch.arange(n), kv.kv_caches, attn, meta, torch.arange(n))


def _hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_past_the_window_equal_transformers(family, built):
    path = built(family)
    torch.testing.assert_close(_our_logits(path, IDS), _hf_logits(path, IDS),
                               atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
], ids=["linear", "yarn"])
def test_scaled_rope_equals_transformers(rope, tmp_path_factory, tiny_tokenizer_dir):
    """Llama with linear / YaRN RoPE scaling (YaRN also scales cos and sin), on the fused
    Llama path."""
    from tests.fixtures.tiny_models import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path_factory, "llama", rope_scaling=rope,
                               tokenizer_dir=tiny_tokenizer_dir)
    torch.testing.assert_close(_our_logits(path, IDS), _hf_logits(path, IDS),
                               atol=2e-4, rtol=1e-4)
