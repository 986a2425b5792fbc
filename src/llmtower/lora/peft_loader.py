"""Reads a PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) and
checks it against the base model; every refusal says what is wrong and what to change."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from llmtower.lora.adapter import MODULES, LoRAAdapter, LoRAModelShape
from llmtower.utils import read_json_object


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served on this model (the message gives the reason)."""


# PEFT's saved key: base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


def read_adapter_config(path: Path) -> dict[str, Any]:
    cfg_file = path / "adapter_config.json"
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter path {str(path)!r} is not a directory: give a "
                               "local folder holding adapter_config.json and "
                               "adapter_model.safetensors")
    if not cfg_file.is_file():
        raise LoRAAdapterError(f"{str(path)!r} has no adapter_config.json: is it a PEFT LoRA "
                               "adapter folder (save_pretrained of a PeftModel)?")
    try:
        return read_json_object(cfg_file)
    except ValueError as e:
        raise LoRAAdapterError(str(e)) from None


def load_peft_adapter(path: str | Path, name: str, int_id: int, shape: LoRAModelShape,
                      dtype: torch.dtype, max_rank: int) -> LoRAAdapter:
    """The adapter at ``path`` for a model of ``shape`` in ``dtype``; raises
    ``LoRAAdapterError`` for a rank above ``max_rank``, modules the model lacks, options we do
    not serve (DoRA, LoRA biases, per-module ranks, modules_to_save) or tensors whose shapes
    belong to another base model."""
    from safetensors.torch import load_file

    p = Path(path)
    cfg = read_adapter_config(p)
    where = f"LoRA adapter {name!r} ({p})"
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {peft_type!r} is not LORA")
    for key, what in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks (rank_pattern)"),
                      ("alpha_pattern", "per-module alphas (alpha_pattern)"),
                      ("modules_to_save", "fully trained modules (modules_to_save)")):
        if cfg.get(key):
            raise LoRAAdapterError(f"{where}: {what} is not supported; train it without {key}")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{where}: bias={cfg['bias']!r} is not supported (LoRA biases); "
                               "train with bias='none'")
    rank = int(cfg.get("r", 0))
    if rank < 1:
        raise LoRAAdapterError(f"{where}: adapter_config.json has no positive rank 'r'")
    if rank > max_rank:
        raise LoRAAdapterError(f"{where}: rank {rank} is above --max-lora-rank={max_rank}; "
                               f"restart with --max-lora-rank {rank} or more")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):  # a regex over full module names: the tensors decide
        targets = []
    unknown = [t for t in targets if t.split(".")[-1] not in MODULES]
    if unknown:
        raise LoRAAdapterError(f"{where}: target modules {unknown} are not in this model's "
                               f"adapter-capable projections ({', '.join(MODULES)})")
    st = p / "adapter_model.safetensors"
    if not st.is_file():
        raise LoRAAdapterError(f"{where}: adapter_model.safetensors is missing (adapters saved "
                               "as .bin are not read; save with safe_serialization=True)")
    tensors = load_file(str(st))
    a: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAAdapterError(f"{where}: tensor {key!r} is not a LoRA A/B matrix of a "
                                   f"decoder projection ({', '.join(MODULES)})")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES:
            raise LoRAAdapterError(f"{where}: targets {module!r}, which this model has no "
                                   f"adapter slot for (use {', '.join(MODULES)})")
        if layer >= shape.num_layers:
            raise LoRAAdapterError(f"{where}: tensor {key!r} is for layer {layer} but the base "
                                   f"model has {shape.num_layers} layers: trained for another "
                                   "base model")
        d_in, d_out = shape.dims[module]
        want = (rank, d_in) if ab == "A" else (d_out, rank)
        if tuple(t.shape) != want:
            raise LoRAAdapterError(f"{where}: {key!r} has shape {tuple(t.shape)} but this base "
                                   f"model and r={rank} need {want}: the adapter was trained "
                                   "for another base model")
        dest = a if ab == "A" else b
        if module not in dest:
            rows, cols = want
            dest[module] = torch.zeros(shape.num_layers, rows, cols, dtype=torch.float32)
        dest[module][layer] = t.to(torch.float32) * (scaling if ab == "B" else 1.0)
    if not a:
        raise LoRAAdapterError(f"{where}: adapter_model.safetensors holds no LoRA matrices")
    if set(a) != set(b):
        raise LoRAAdapterError(f"{where}: A and B matrices do not pair up "
                               f"(A for {sorted(a)}, B for {sorted(b)})")
    # Scaled in float32, then stored in the model's dtype.
    return LoRAAdapter(name, int_id, rank, scaling,
                       {k: v.to(dtype).contiguous() for k, v in a.items()},
                       {k: v.to(dtype).contiguous() for k, v in b.items()}, str(p))
