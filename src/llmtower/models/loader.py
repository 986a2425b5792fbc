"""The public entry points of model loading: turn ``--model`` into a local Hugging Face directory,
then read its config, weights and tokenizer from it.

    path = resolve_model_path(args.model)          # default name, a .gguf file, or an HF directory
    config = load_model_config(path)
    weights = load_state_dict(path, torch.float32)  # Hugging Face tensor names
    tokenizer = load_tokenizer(path)
"""
from __future__ import annotations

from pathlib import Path

import torch

from llmtower.models import weights as _weights
from llmtower.models.config import ModelConfig
from llmtower.models.default_model import DEFAULT_MODEL_NAME, default_model_dir, is_default_model_name
from llmtower.models.gguf_cache import cached_hf_dir
from llmtower.models.tokenizer import load_tokenizer

__all__ = ["ModelConfig", "resolve_model_path", "load_model_config", "load_state_dict", "load_tokenizer"]

# Tensors some checkpoints carry that are recomputed, not learned.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def resolve_model_path(model: str | Path | None) -> Path:
    """A local Hugging Face model directory ready to load, for ``model`` being None or
    'smollm2-135m-instruct' (the default), a .gguf file (converted and cached on first use), or a
    directory with config.json. Nothing is ever downloaded."""
    if model is None or (isinstance(model, str) and is_default_model_name(model)):
        return default_model_dir()
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return cached_hf_dir(path)
        if path.name == "config.json":
            return path.parent.resolve()
        raise ValueError(f"model file {path} is not a .gguf file: pass a .gguf file or a Hugging Face "
                         "model directory (config.json + *.safetensors)")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it holds {', '.join(ggufs)}: pass one of those files as the model" if ggufs else ""
        raise FileNotFoundError(f"config.json not found in {path}: a model directory needs config.json "
                                f"and *.safetensors{hint}")
    raise FileNotFoundError(f"model {str(model)!r} not found: pass a local Hugging Face model directory "
                            f"(config.json + *.safetensors), a .gguf file, or {DEFAULT_MODEL_NAME!r}; "
                            "llmtower never downloads models")


def load_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a model directory (from its config.json)."""
    return ModelConfig.from_hf_config(path)


def load_state_dict(path: str | Path, dtype: str | torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The weights of a model directory under Hugging Face names, cast to ``dtype``.

    ``lm_head.weight`` is absent exactly when the config ties it to ``model.embed_tokens.weight``.
    """
    config = load_model_config(path)
    state = _weights.load_state_dict(path, dtype)
    if config.architecture == "Phi3ForCausalLM":
        _split_phi3_projections(state, config)
    for name in [n for n in state if n.endswith(_IGNORED_SUFFIXES)]:
        del state[name]
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise ValueError(f"{path} has no lm_head.weight but its config.json says "
                         "tie_word_embeddings=false: set it to true if the embeddings are shared")
    if "model.embed_tokens.weight" not in state:
        raise ValueError(f"{path} has no model.embed_tokens.weight: is it a Hugging Face Llama-family checkpoint?")
    return state


def _split_phi3_projections(state: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Phi-3 stores each layer's q/k/v as one ``qkv_proj`` (q rows, then k, then v) and gate/up
    as one ``gate_up_proj`` (gate rows, then up): give them Llama's names, in place. The model
    fuses them again in its own layout (``LlamaForCausalLM._load_layer``)."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    for name in [n for n in state if n.endswith((".qkv_proj.weight", ".gate_up_proj.weight"))]:
        w = state.pop(name)
        prefix = name.rsplit(".", 2)[0]
        if name.endswith(".qkv_proj.weight"):
            if w.shape[0] != q + 2 * kv:
                raise ValueError(f"tensor {name!r} has {w.shape[0]} rows but config.json implies "
                                 f"{q + 2 * kv} (q {q} + k {kv} + v {kv})")
            parts = zip(("q_proj", "k_proj", "v_proj"), w.split([q, kv, kv]))
        else:
            if w.shape[0] != 2 * config.intermediate_size:
                raise ValueError(f"tensor {name!r} has {w.shape[0]} rows but config.json implies "
                                 f"{2 * config.intermediate_size} (gate + up)")
            parts = zip(("gate_proj", "up_proj"), w.chunk(2))
        for part, t in parts:
            state[f"{prefix}.{part}.weight"] = t
