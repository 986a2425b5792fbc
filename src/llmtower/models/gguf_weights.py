"""A GGUF file's weights under their Hugging Face names, read from the file itself (no converted
copy on disk).

- ``gguf_float_state_dict``: every tensor dequantized to the model's dtype, one tensor at a
  time (the block formats by the kernel library's exact decoder, others by gguf's), so loading
  holds one float32 tensor beside the result, never a float32 copy of the model.
- ``gguf_block_state_dict`` (``--quantization gguf``): the quantized matrices as
  ``GGUFMatrix`` locations, read later in their own format by the model
  (``models/quant_block.py``); 1-D tensors (norms, biases) as float32.

Both undo llama.cpp's q/k row permutation (``gguf_loader.unpermute_qk``): on float values, or
as a row order for the blocks (rows are independent in every block format).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from llmtower.kernels.quant_gemm import BLOCK_FORMATS, from_numpy
from llmtower.models.config import ModelConfig
from llmtower.models.gguf_dequant import dequantize
from llmtower.models.gguf_index import TensorInfo, read_tensor_index, tensor_data
from llmtower.models.gguf_loader import _ARCHITECTURES, hf_tensor_name, unpermute_qk
from llmtower.models.gguf_rope import CONFIG_TENSORS
from llmtower.models.quant_block import GGUFMatrix

_Q = GGMLQuantizationType
# The file in a cached model directory that names the GGUF its weights come from.
GGUF_SOURCE = "gguf_source.json"
_FLOAT_TYPES = (_Q.F32, _Q.F16, _Q.BF16)


def write_gguf_source(out_dir: Path, gguf_path: Path) -> None:
    """Record in ``out_dir`` that its weights are read from ``gguf_path``."""
    st = gguf_path.stat()
    (out_dir / GGUF_SOURCE).write_text(json.dumps(
        {"path": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns},
        indent=2) + "\n")


def gguf_source(directory: str | Path) -> Path | None:
    """The GGUF file a cached model directory reads its weights from (None: an ordinary
    Hugging Face directory). A GGUF changed since the directory was made is refused."""
    marker = Path(directory) / GGUF_SOURCE
    if not marker.is_file():
        return None
    info = json.loads(marker.read_text())
    path = Path(info["path"])
    if not path.is_file():
        raise FileNotFoundError(f"{directory} reads its weights from {path}, which no longer "
                                "exists: pass the .gguf file again as the model")
    st = path.stat()
    if (st.st_size, st.st_mtime_ns) != (info["size"], info["mtime_ns"]):
        raise ValueError(f"{path} changed after {directory} was made from it: pass the .gguf "
                         "file as the model (a fresh directory is made for it)")
    return path


def _heads(name: str, config: ModelConfig, permuted: bool) -> int | None:
    """The head count whose permutation llama.cpp applied to this tensor's rows, if any."""
    if permuted and ".self_attn.q_proj." in name:
        return config.num_attention_heads
    if permuted and ".self_attn.k_proj." in name:
        return config.num_key_value_heads
    return None


def _permuted(config: ModelConfig) -> bool:
    """Whether llama.cpp's converter permuted this architecture's q/k rows."""
    return any(i["permuted_qk"] and i["architecture"] == config.architecture
               for i in _ARCHITECTURES.values())


def _float32(mm: np.ndarray, t: TensorInfo) -> np.ndarray:
    """A tensor's values as float32 numpy (the kernel library's decoder for the block
    formats: exact, and fast enough to load a model at start-up)."""
    data = tensor_data(mm, t)
    if t.qtype in _FLOAT_TYPES or int(t.qtype) not in BLOCK_FORMATS:
        return dequantize(data, t.qtype)
    k = t.shape[-1]
    with warnings.catch_warnings():  # the file's mapping is read-only; nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        return from_numpy(int(t.qtype), data, data.shape[0], k).dequantize().numpy().reshape(
            t.shape)


def _check_vocab(state: dict, config: ModelConfig) -> None:
    embed = state.get("model.embed_tokens.weight")
    rows = None if embed is None else embed.shape[0]
    if rows != config.vocab_size:
        raise ValueError(f"token_embd rows ({rows}) do not match the tokenizer's "
                         f"{config.vocab_size} tokens")


def gguf_float_state_dict(path: Path, config: ModelConfig, dtype: torch.dtype
                          ) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF dequantized to ``dtype`` under its Hugging Face name."""
    permuted = _permuted(config)
    state: dict[str, torch.Tensor] = {}
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for t in read_tensor_index(path):
        if t.name in CONFIG_TENSORS:  # read into the config (gguf_rope)
            continue
        name = hf_tensor_name(t.name)
        w = _float32(mm, t)
        heads = _heads(name, config, permuted)
        if heads is not None:
            w = unpermute_qk(w, heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    _check_vocab(state, config)
    return state


def gguf_block_state_dict(path: Path, config: ModelConfig
                          ) -> dict[str, torch.Tensor | GGUFMatrix]:
    """The GGUF's tensors under their Hugging Face names: quantized matrices as
    ``GGUFMatrix`` (nothing read yet), float and 1-D tensors as float32."""
    permuted = _permuted(config)
    state: dict[str, torch.Tensor | GGUFMatrix] = {}
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for t in read_tensor_index(path):
        if t.name in CONFIG_TENSORS:  # read into the config (gguf_rope)
            continue
        name = hf_tensor_name(t.name)
        heads = _heads(name, config, permuted)
        if len(t.shape) == 2 and t.qtype not in _FLOAT_TYPES:
            n, k = t.shape
            order = None if heads is None else np.ascontiguousarray(
                unpermute_qk(np.arange(n), heads))
            state[name] = GGUFMatrix(Path(path), t.offset, int(t.qtype), n, k, order)
            continue
        w = dequantize(tensor_data(mm, t), t.qtype)
        if heads is not None:
            w = unpermute_qk(w, heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    _check_vocab(state, config)
    return state
