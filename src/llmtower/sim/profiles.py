"""Device and model profiles: the numbers the cost model multiplies, read from JSON files.

The shipped profiles live next to this file (``profiles/*.json``); each says where its numbers
come from in a ``source`` field. A user adds a device or a model by writing a JSON file of the
same shape and passing its path (``--device my_gpu.json``), or by dropping it into a directory
named by ``$LLMTOWER_PROFILE_PATH`` (or ``$XDG_CACHE_HOME/llmtower/profiles``, where
``llmtower simulate calibrate`` writes), which is searched before the shipped ones.
A model may also be given as a Hugging Face model directory: its config.json is read.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

SHIPPED_DIR = Path(__file__).parent / "profiles"

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8": 1}


@dataclass(frozen=True)
class DeviceProfile:
    """Owns one accelerator's capabilities as the roofline sees them.

    ``peak_flops`` and ``mem_bandwidth`` are spec-sheet numbers; the cost model multiplies them
    by ``compute_efficiency`` and ``bandwidth_efficiency``. ``step_overhead_s`` is the fixed cost
    of one engine step (scheduling, input preparation, sampling, kernel launches);
    ``seq_overhead_s`` a cost per scheduled request (0 on GPUs, fitted on CPU). ``overlap`` says
    how compute and memory traffic combine: ``max`` (the roofline: they overlap, as on GPUs) or
    ``sum`` (they take turns; calibration picks it when it fits a CPU better). ``link_*`` is the
    tensor-parallel interconnect (per direction), ``host_bandwidth`` the device<->CPU link that
    swapping uses. ``default_kv_cache_bytes`` (per rank) replaces the memory-minus-weights rule
    where an engine sizes its KV cache otherwise (the CPU engine's ``--kv-cache-memory``).
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: float
    compute_efficiency: float = 0.55
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.002
    seq_overhead_s: float = 0.0
    overlap: str = "max"
    link_bandwidth: float = 0.0
    link_efficiency: float = 0.8
    link_latency_s: float = 0.0
    host_bandwidth: float = 32e9
    default_kv_cache_bytes: float = 0.0  # per rank; 0: memory x utilization - weights
    description: str = ""
    source: str = ""
    notes: str = ""
    calibration: dict | None = None

    def __post_init__(self) -> None:
        for f in ("peak_flops", "mem_bandwidth", "memory_bytes", "host_bandwidth"):
            _positive(self.name, f, getattr(self, f))
        for f in ("compute_efficiency", "bandwidth_efficiency", "link_efficiency"):
            v = getattr(self, f)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"device profile {self.name!r}: {f}={v!r} must be in (0, 1]")
        if self.overlap not in ("max", "sum"):
            raise ValueError(f"device profile {self.name!r}: overlap={self.overlap!r} must be "
                             "'max' (compute and memory traffic overlap) or 'sum' (they do not)")
        for f in ("step_overhead_s", "seq_overhead_s", "link_bandwidth", "link_latency_s",
                  "default_kv_cache_bytes"):
            if getattr(self, f) < 0:
                raise ValueError(f"device profile {self.name!r}: {f} must be >= 0")

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.compute_efficiency

    @property
    def effective_bandwidth(self) -> float:
        return self.mem_bandwidth * self.bandwidth_efficiency

    def to_json(self) -> dict[str, Any]:
        return {"kind": "device", **{k: v for k, v in asdict(self).items() if v is not None}}


@dataclass(frozen=True)
class ModelProfile:
    """Owns a transformer's shapes and the FLOP / byte counts derived from them (per token,
    per context token, per step), which is all the cost model needs to know about a model."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    dtype: str = "bfloat16"
    kv_cache_dtype: str = ""  # "": same as dtype
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                  "vocab_size", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"model profile {self.name!r}: {f}={v!r} must be an integer >= 1")
        for f in ("dtype", "kv_cache_dtype"):
            v = getattr(self, f)
            if v and v not in _DTYPE_BYTES:
                raise ValueError(f"model profile {self.name!r}: {f}={v!r} must be one of "
                                 f"{sorted(_DTYPE_BYTES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model profile {self.name!r}: num_heads={self.num_heads} must be a "
                             f"multiple of num_kv_heads={self.num_kv_heads}")

    # ------------------------------------------------------------------ shapes
    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def kv_dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.kv_cache_dtype or self.dtype]

    @property
    def linear_params_per_layer(self) -> int:
        """q, k, v, o projections and the gated MLP (gate, up, down)."""
        h, d = self.hidden_size, self.head_size
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        return attn + 3 * h * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        embed = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_layers * self.linear_params_per_layer + self.lm_head_params + embed

    @property
    def weight_bytes(self) -> int:
        """Memory the weights occupy."""
        return self.num_params * self.dtype_bytes

    @property
    def weight_bytes_read_per_step(self) -> int:
        """Weights streamed from memory by one forward pass: every linear layer and the LM
        head; the embedding table is only gathered (a few rows), so it does not count."""
        params = self.num_layers * self.linear_params_per_layer + self.lm_head_params
        return params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.kv_dtype_bytes

    @property
    def linear_flops_per_token(self) -> int:
        return 2 * self.num_layers * self.linear_params_per_layer

    @property
    def lm_head_flops_per_sample(self) -> int:
        return 2 * self.lm_head_params

    @property
    def attn_flops_per_context_token(self) -> int:
        """QK^T and AV for one query token against one key token, all layers."""
        return 4 * self.num_layers * self.num_heads * self.head_size

    def to_json(self) -> dict[str, Any]:
        return {"kind": "model", **asdict(self)}

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str, source: str = "") -> ModelProfile:
        """A profile from a Hugging Face config.json (Llama, Qwen2, Mistral families)."""
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size", "vocab_size") if k not in config]
        if missing:
            raise ValueError(f"{source or name}: config.json lacks {', '.join(missing)}; "
                             "it is not a decoder model this simulator can profile")
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        return cls(
            name=name, hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
            head_dim=config.get("head_dim") or 0,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=config.get("max_position_embeddings", 8192),
            dtype=dtype if dtype in _DTYPE_BYTES else "bfloat16", source=source)


# ---------------------------------------------------------------------- loading
def _positive(name: str, field: str, value: float) -> None:
    if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"device profile {name!r}: {field}={value!r} must be a number > 0")


def search_dirs() -> list[Path]:
    """Where profiles are looked up by name, first match wins."""
    dirs = [Path(p) for p in os.environ.get("LLMTOWER_PROFILE_PATH", "").split(os.pathsep) if p]
    dirs.append(user_profile_dir())
    dirs.append(SHIPPED_DIR)
    return dirs


def user_profile_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "llmtower" / "profiles"


def available(kind: str) -> list[str]:
    """Names of the profiles of ``kind`` ('device' or 'model') found on the search path."""
    names: set[str] = set()
    for d in search_dirs():
        for p in d.glob("*.json") if d.is_dir() else ():
            try:
                if json.loads(p.read_text()).get("kind") == kind:
                    names.add(p.stem)
            except (OSError, ValueError):
                continue
    return sorted(names)


def _find(name_or_path: str, kind: str) -> tuple[dict[str, Any], str]:
    p = Path(name_or_path)
    if p.suffix == ".json" or p.is_file():
        if not p.is_file():
            raise FileNotFoundError(f"{kind} profile file {name_or_path} does not exist")
        return _read(p, kind), str(p)
    if kind == "model" and p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"{p} has no config.json: pass a model profile name or file")
        return {"__hf__": json.loads(cfg.read_text())}, str(cfg)
    for d in search_dirs():
        f = d / f"{name_or_path}.json"
        if f.is_file():
            return _read(f, kind), str(f)
    raise ValueError(f"unknown {kind} profile {name_or_path!r}: use one of "
                     f"{', '.join(available(kind))}, or the path of a JSON profile file")


def _read(path: Path, kind: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or data.get("kind", kind) != kind:
        raise ValueError(f"{path} is not a {kind} profile (its \"kind\" is {data.get('kind')!r})")
    return data


def _build(cls, data: dict[str, Any], origin: str):
    known = {f.name for f in fields(cls)}
    data = {k: v for k, v in data.items() if k != "kind"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{origin}: unknown field(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(sorted(known))}")
    try:
        return cls(**data)
    except TypeError as e:
        raise ValueError(f"{origin}: {e}") from None


def load_device(name_or_path: str) -> DeviceProfile:
    data, origin = _find(name_or_path, "device")
    data.setdefault("name", Path(origin).stem)
    return _build(DeviceProfile, data, origin)


def load_model(name_or_path: str) -> ModelProfile:
    data, origin = _find(name_or_path, "model")
    if "__hf__" in data:
        return ModelProfile.from_hf_config(data["__hf__"], Path(origin).parent.name, origin)
    data.setdefault("name", Path(origin).stem)
    return _build(ModelProfile, data, origin)


def save_profile(profile: DeviceProfile | ModelProfile, path: str | os.PathLike) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    return out
