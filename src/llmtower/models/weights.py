"""Read a Hugging Face checkpoint's *.safetensors files into one state dict of torch tensors."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from llmtower.models.config import ModelConfig
from llmtower.models.gguf_weights import gguf_float_state_dict, gguf_source

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           # On CPU float32 is the fast and exact choice whatever the checkpoint was saved in.
           "auto": torch.float32}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' | 'auto' (= float32) | a torch.dtype -> torch.dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported: use one of {', '.join(_DTYPES)}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported: use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def safetensors_files(directory: str | Path) -> list[Path]:
    """The checkpoint files of a model directory, in shard order."""
    directory = Path(directory)
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        shards = list(dict.fromkeys(weight_map.values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard(s) missing from {directory}: {', '.join(missing)}")
        return [directory / s for s in shards]
    if (directory / SAFETENSORS_SINGLE).is_file():
        return [directory / SAFETENSORS_SINGLE]
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    hint = ""
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        hint = " (PyTorch .bin/.pt checkpoints are not read: re-save with save_pretrained(safe_serialization=True))"
    raise FileNotFoundError(f"no model weights in {directory}: expected {SAFETENSORS_SINGLE} or "
                            f"{SAFETENSORS_INDEX} with its shards{hint}")


def load_state_dict(path: str | Path, dtype: str | torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors of a model directory under their Hugging Face names, cast to ``dtype``.

    Tensors are read one at a time so peak memory stays near the size of the result.
    """
    target = resolve_dtype(dtype)
    source = gguf_source(path)
    if source is not None:  # a GGUF's directory (gguf_cache): the weights are in the file
        return gguf_float_state_dict(source, ModelConfig.from_hf_config(path), target)
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in state:
                    raise ValueError(f"tensor {name!r} appears in more than one shard of {path}")
                state[name] = f.get_tensor(name).to(target)
    return state
