"""ModelConfig: the shape of a Llama-family model, read from a Hugging Face config.json.

Everything the model code needs and nothing else. Both the legacy config.json layout
(``rope_theta`` + ``rope_scaling``) and the transformers v5 layout (``rope_parameters``) are read.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmtower.utils import read_json_object
from llmtower.models.registry import (FAMILIES, architecture_of_model_type, check_architecture,
                                      supported_architectures)

SUPPORTED_ARCHITECTURES = supported_architectures()
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope")
# The MLP activations of the supported families (Gemma's GeGLU: gelu_pytorch_tanh).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Each scaled rope type's required parameters.
_ROPE_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    # One set of per-frequency factors (short_factor == long_factor): what a GGUF's rope_freqs
    # tensor holds (Llama 3.1+ converted by llama.cpp), in the form transformers reads.
    "longrope": ("short_factor", "long_factor"),
}


@dataclass
class ModelConfig:
    """Owns the hyperparameters of one Llama-family decoder (Llama, Qwen2, Qwen3, Mistral,
    Phi-3, SmolLM).

    ``num_key_value_heads=0`` means "as many as attention heads" (no GQA) and ``head_dim=0`` means
    ``hidden_size // num_attention_heads``; both are filled in on construction.
    ``rope_scaling`` is None for plain RoPE, else a dict with ``rope_type`` (llama3, linear,
    dynamic, yarn, or longrope with one set of per-frequency factors) and its parameters
    (``models/layers/rotary.py`` applies them).
    ``attention_bias`` means q/k/v projections carry a bias (always for Qwen2). Whether o_proj has
    one too differs by family (Llama with attention_bias: yes; Qwen2: no), so the model should
    follow the weights: o_proj has a bias exactly when ``...self_attn.o_proj.bias`` is present.
    ``sliding_window`` is the attention window of the windowed layers, as written in config.json
    (None: none); ``layer_types`` says which layers are windowed ("sliding_attention") and which
    global ("full_attention"); None: every layer windowed when there is a window
    (``layer_sliding_windows`` gives the per-layer answer). Phi-3 is Llama with q/k/v and gate/up stored fused (``loader`` splits them).
    ``qk_norm`` (Qwen3) means each head's query and key are RMS-normalized, with weights of
    ``head_dim`` per layer, before the rotary embedding.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    qk_norm: bool = False
    # The whole config.json: the family-specific settings each family reads itself
    # (``get``), so that adding a family does not touch this class.
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: it must be a positive integer")
        if self.num_key_value_heads == 0:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                                 f"{self.num_attention_heads}: set head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported: the MLPs use "
                             f"{' or '.join(SUPPORTED_ACTIVATIONS)}")
        self.rope_scaling = _check_rope_scaling(self.rope_scaling, self.max_position_embeddings)
        _check_window(self.sliding_window, self.layer_types, self.num_hidden_layers)
        self.eos_token_ids = [int(t) for t in self.eos_token_ids]

    def get(self, key: str, default: Any = None) -> Any:
        """A family-specific config.json setting (``default`` where absent or null)."""
        value = self.raw.get(key)
        return default if value is None else value

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def layer_sliding_windows(self) -> list[int | None]:
        """Each layer's attention window (a query at position p sees the keys at positions
        > p - window, as transformers masks them), or None for a global layer."""
        n = self.num_hidden_layers
        if not self.sliding_window:
            return [None] * n
        if self.layer_types is None:
            return [self.sliding_window] * n
        return [self.sliding_window if t == "sliding_attention" else None
                for t in self.layer_types]

    @property
    def all_layers_windowed(self) -> bool:
        """Every layer attends only to its window: a request's blocks before the window can be
        freed (core/kv_cache/sliding_window.py)."""
        return all(w is not None for w in self.layer_sliding_windows())

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` for extra EOS ids) from a model
        directory, or from the path of a config.json itself."""
        path = Path(path)
        file = path if path.name == "config.json" and path.is_file() else path / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"config.json not found in {file.parent}: a model directory needs "
                                    "config.json next to its *.safetensors weights")
        cfg = read_json_object(file)
        try:
            return cls._from_dict(cfg, file)
        except KeyError as e:
            raise ValueError(f"{file} lacks the required key {e.args[0]!r}") from None

    @classmethod
    def _from_dict(cls, cfg: dict[str, Any], file: Path) -> ModelConfig:
        arch = _architecture(cfg, file)
        if cfg.get("mlp_bias"):
            raise ValueError(f"{file}: mlp_bias=true is not supported (Llama-family MLPs have no bias)")
        rope_theta, rope_scaling = _rope(cfg)
        sliding_window, layer_types = hf_sliding_windows(cfg, arch)
        if arch == "Phi3ForCausalLM":
            partial = (cfg.get("rope_parameters") or {}).get(
                "partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
            if partial != 1.0:
                raise ValueError(f"{file}: partial_rotary_factor={partial} (rotary embeddings on "
                                 "part of each head, as in Phi-4-mini) is not supported")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or 0,
            head_dim=cfg.get("head_dim") or 0,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; its config.json has no key for it.
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            # Gemma names it hidden_activation.
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg, file.parent / "generation_config.json"),
            sliding_window=sliding_window,
            layer_types=layer_types,
            qk_norm=arch == "Qwen3ForCausalLM",
            raw=dict(cfg),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json transformers and llmtower both read back (legacy rope keys)."""
        d = asdict(self)
        arch = d.pop("architecture")
        eos = d.pop("eos_token_ids")
        d.pop("qk_norm")  # implied by the architecture (Qwen3)
        raw = d.pop("raw")
        out: dict[str, Any] = dict(raw)
        out.update({"architectures": [arch], "model_type": FAMILIES[arch].model_type})
        out.update(d)
        out["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        out["mlp_bias"] = False
        out["torch_dtype"] = "float32"
        if out["layer_types"] is None:
            del out["layer_types"]
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            out["use_sliding_window"] = self.sliding_window is not None
            if self.sliding_window is not None and self.layer_types is None:
                out["max_window_layers"] = 0  # every layer windowed
        return out


LAYER_TYPES = ("sliding_attention", "full_attention")
# Families whose windowed layers alternate with global ones when config.json has no
# layer_types: model_type -> (the default period, the config key that overrides it). Layer i is
# global when (i + 1) % period == 0, as transformers builds their layer_types.
_ALTERNATING = {"gemma2": (2, ""), "gemma3_text": (6, "sliding_window_pattern"),
                "gemma3": (6, "sliding_window_pattern"), "gpt_oss": (2, "")}


def hf_sliding_windows(cfg: dict[str, Any], arch: str) -> tuple[int | None, list[str] | None]:
    """(window, layer_types) of a config.json, as transformers reads them: Mistral, Phi-3 and
    Mixtral window every layer; Qwen2 / Qwen3 (and their MoE) only with use_sliding_window,
    from layer max_window_layers on; Gemma 2 / gpt-oss every other layer, Gemma 3 five in six
    (sliding_window_pattern); an explicit layer_types wins (except for Mistral, whose
    transformers class ignores it)."""
    window = cfg.get("sliding_window") or None
    model_type = cfg.get("model_type") or (FAMILIES[arch].model_type if arch in FAMILIES else "")
    n = int(cfg.get("num_hidden_layers") or 0)
    if model_type == "llama" or (model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
                                 and not cfg.get("use_sliding_window")):
        return None, None  # transformers' Llama has no window
    if window is None or model_type in ("mistral", "mixtral", "phi3"):
        return window, None
    if cfg.get("layer_types") is not None:
        return window, [str(t) for t in cfg["layer_types"]]
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        first = int(cfg.get("max_window_layers", n))
        return window, [LAYER_TYPES[0] if i >= first else LAYER_TYPES[1] for i in range(n)]
    if model_type == "qwen2_moe":
        last = int(cfg.get("max_window_layers", n))
        return window, [LAYER_TYPES[0] if (i + 1) % 2 and i < last else LAYER_TYPES[1]
                        for i in range(n)]
    if model_type in _ALTERNATING:
        period, key = _ALTERNATING[model_type]
        period = int(cfg.get(key, period)) if key else period
        return window, [LAYER_TYPES[0] if (i + 1) % period else LAYER_TYPES[1]
                        for i in range(n)]
    return window, None


def _check_window(window: int | None, layer_types: list[str] | None, num_layers: int) -> None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window={window!r} is invalid: a positive number of tokens "
                         "(or null for none)")
    if layer_types is None:
        return
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries but the model has "
                         f"{num_layers} layers: one per layer")
    bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if bad:
        raise ValueError(f"layer_types {', '.join(map(repr, bad))} not supported: each layer is "
                         f"one of {', '.join(LAYER_TYPES)}")


def _architecture(cfg: dict[str, Any], file: Path) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else architecture_of_model_type(cfg.get("model_type", ""))
    check_architecture(arch or f"model_type={cfg.get('model_type')!r}", str(file))
    return arch


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "full_attention" in params:  # per layer type (Gemma 3): the global layers' here
        params = params["full_attention"]
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta), dict(params) if params else None


def _check_rope_scaling(scaling: dict[str, Any] | None,
                        max_position_embeddings: int) -> dict[str, Any] | None:
    """Normalize to None (plain RoPE) or {"rope_type": <a scaled type>, <its parameters>}."""
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in _ROPE_KEYS:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported: llmtower supports "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    scaling = dict(scaling)
    if rope_type == "yarn":  # transformers' default: the length the config states
        scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
    missing = [k for k in _ROPE_KEYS[rope_type] if scaling.get(k) is None]
    if missing:
        raise ValueError(f"{rope_type} rope scaling lacks {', '.join(missing)}: it needs "
                         f"{', '.join(_ROPE_KEYS[rope_type])}")
    keep = _ROPE_KEYS[rope_type] if rope_type == "llama3" else tuple(
        k for k, v in scaling.items() if k not in ("type", "rope_type", "rope_theta") and v is not None)
    out: dict[str, Any] = {"rope_type": rope_type}
    out.update({k: scaling[k] for k in keep})
    if rope_type == "longrope":
        return _longrope(out, max_position_embeddings)
    out["factor"] = float(scaling["factor"])
    if "original_max_position_embeddings" in out:
        out["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    for k in ("low_freq_factor", "high_freq_factor"):
        if k in out:
            out[k] = float(out[k])
    if rope_type == "dynamic":  # NTK grows the base past the trained length
        out["max_position_embeddings"] = max_position_embeddings
    return out


def _longrope(s: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """LongRoPE with one set of per-frequency factors, and its attention factor as transformers
    derives it. Phi-3's distinct short and long factors (switched on the sequence's length, which
    a paged cache whose keys were rotated earlier cannot follow) are refused."""
    short = [float(f) for f in s["short_factor"]]
    if short != [float(f) for f in s["long_factor"]]:
        raise ValueError("rope scaling type 'longrope' is not supported with different short_factor "
                         "and long_factor (Phi-3 128k): llmtower supports "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}, longrope with short_factor == "
                         "long_factor only")
    s["short_factor"] = s["long_factor"] = short
    original = int(s.get("original_max_position_embeddings") or max_position_embeddings)
    if s.get("attention_factor") is None:
        factor = s.get("factor") or max_position_embeddings / original
        s["attention_factor"] = (1.0 if factor <= 1.0
                                 else math.sqrt(1 + math.log(factor) / math.log(original)))
    s["attention_factor"] = float(s["attention_factor"])
    s["original_max_position_embeddings"] = original
    return s


def _eos_ids(cfg: dict[str, Any], generation_config: Path) -> list[int]:
    """EOS ids of config.json, then any extra ones of generation_config.json (chat models often
    list their end-of-turn token only there), without duplicates, in that order."""
    ids: list[int] = []
    sources = [cfg.get("eos_token_id")]
    if generation_config.is_file():
        try:
            sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{generation_config} is not valid JSON: {e}") from e
    for value in sources:
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids
