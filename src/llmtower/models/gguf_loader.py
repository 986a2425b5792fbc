"""Read a llama.cpp GGUF file as a ModelConfig and a Hugging Face-named float32 state dict.

llama.cpp's converter permutes the rows of q_proj and k_proj of llama-architecture models so
that its RoPE can rotate adjacent pairs; Hugging Face's rotate_half rotates the two halves of each
head instead. ``unpermute_qk`` undoes that, so the weights work with HF-style RoPE.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType

from llmtower.models.config import ModelConfig
from llmtower.models.gguf_dequant import dequantize
from llmtower.models.gguf_rope import CONFIG_TENSORS, gguf_rope_scaling, shortest_float


# GGUF general.architecture -> its Hugging Face architecture, and whether llama.cpp's converter
# permuted its q/k rows (it does for "llama", which also covers Mistral and SmolLM).
_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {"architecture": "LlamaForCausalLM", "permuted_qk": True, "attention_bias": False},
    "qwen2": {"architecture": "Qwen2ForCausalLM", "permuted_qk": False, "attention_bias": True},
    "qwen3": {"architecture": "Qwen3ForCausalLM", "permuted_qk": False, "attention_bias": False},
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(_ARCHITECTURES)

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
}


def open_gguf(path: str | Path) -> GGUFReader:
    """A GGUFReader over ``path`` (memory-mapped), with a clear error for non-GGUF files."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        return GGUFReader(str(path), "r")
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def field_value(reader: GGUFReader, key: str, default: Any = ...) -> Any:
    """The value of metadata ``key``: int, float, bool, str, or a list of those."""
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise ValueError(f"the GGUF file lacks the metadata key {key!r}")
        return default
    if f.types[0] == GGUFValueType.ARRAY:
        if f.types[-1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if f.types[0] == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]].tolist()[0]


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of q/k rows (HF layout -> GGUF layout), per head: the rows of the
    first and second halves of the head dimension are interleaved."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``permute_qk`` (GGUF layout -> HF layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(gguf_name: str) -> str:
    """llama.cpp tensor name -> Hugging Face name, e.g. blk.3.attn_q.weight ->
    model.layers.3.self_attn.q_proj.weight."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}: names end in .weight or .bias")
    if base in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart known to llmtower")


def _gguf_arch(reader: GGUFReader) -> tuple[str, dict[str, Any]]:
    arch = field_value(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported: llmtower reads "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} GGUF files")
    return arch, _ARCHITECTURES[arch]


def gguf_model_config(reader: GGUFReader) -> ModelConfig:
    """A ModelConfig from the GGUF metadata (``<arch>.*`` and ``tokenizer.ggml.*`` keys)."""
    arch, info = _gguf_arch(reader)
    tensor_names = {t.name for t in reader.tensors}
    heads = field_value(reader, f"{arch}.attention.head_count")
    hidden = field_value(reader, f"{arch}.embedding_length")
    head_dim = field_value(reader, f"{arch}.attention.key_length", hidden // heads)
    rot_dim = field_value(reader, f"{arch}.rope.dimension_count", head_dim)
    if rot_dim != head_dim:
        raise ValueError(f"partial rotary embeddings (rope.dimension_count={rot_dim} < head_dim={head_dim}) "
                         "are not supported")
    context_length = field_value(reader, f"{arch}.context_length")
    rope_scaling = gguf_rope_scaling(reader, lambda key, default: field_value(reader, key, default),
                                     arch, context_length)
    eos = [field_value(reader, "tokenizer.ggml.eos_token_id", None)]
    eos.append(field_value(reader, "tokenizer.ggml.eot_token_id", None))
    return ModelConfig(
        architecture=info["architecture"],
        vocab_size=len(field_value(reader, "tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=field_value(reader, f"{arch}.feed_forward_length"),
        num_hidden_layers=field_value(reader, f"{arch}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=field_value(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=shortest_float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=shortest_float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=context_length,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=info["attention_bias"],
        hidden_act="silu",
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=list(dict.fromkeys(t for t in eos if t is not None)),
    )


def gguf_state_dict(reader: GGUFReader, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF, dequantized to float32, under its Hugging Face name."""
    _, info = _gguf_arch(reader)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in CONFIG_TENSORS:
            continue
        name = hf_tensor_name(t.name)
        w = dequantize(t.data, t.tensor_type)
        if info["permuted_qk"] and ".self_attn.q_proj." in name:
            w = unpermute_qk(w, config.num_attention_heads)
        elif info["permuted_qk"] and ".self_attn.k_proj." in name:
            w = unpermute_qk(w, config.num_key_value_heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    embed = state.get("model.embed_tokens.weight")
    if embed is None or embed.shape[0] != config.vocab_size:
        raise ValueError(f"token_embd rows ({None if embed is None else embed.shape[0]}) do not match the "
                         f"tokenizer's {config.vocab_size} tokens")
    return state
