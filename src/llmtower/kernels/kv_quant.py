"""KV cache dtypes (``--kv-cache-dtype``) and the int8 KV layout: quantize on write, dequantize
on read.

An int8 cache keeps the paged layout of ``kv_cache.py`` but each token's row of one KV head
carries its own scales, one per group of 32 consecutive channels, packed behind the values:

    kv_caches[layer] : int8 [2, num_blocks, block_size, num_kv_heads, head_dim + 4 * groups]
                                                                      └─ head_dim int8 values,
                                                                         then one float32 scale
                                                                         per 32 values (same row)

Why per token and head (not per block): a token's K/V is written once, when the token is
computed, and never changes; a per-token scale is final at that moment, so no block ever has
to be re-quantized when a later token with a larger magnitude joins it, and the error of one
row never depends on its neighbours (an outlier token spoils only itself). Why groups of 32
channels inside the row: SmolLM2's keys have a few outlier channels, and one scale for the
whole 64-value row left the other channels a handful of levels (greedy agreement with float32
KV 74% on 24 prompts, against 90% with groups of 32 and 92% with groups of 16). Symmetric absmax
scaling (scale = max|x| / 127) keeps each value within scale/2 of the original. The scales cost
8 bytes per 64-value head row (12.5%), so an int8 pool holds 3.56x the float32 tokens (1.78x
the bfloat16 ones) at head_dim 64. A head_dim that is no multiple of 32 gets one scale per row.

Packing the scales into the same tensor means every existing block operation (swap out/in,
the relocator's moves, draft-model copies) copies them with the values, untouched.
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")
SCALE_BYTES = 4  # float32 scales
GROUP = 32  # channels sharing one scale
_QMAX = 127.0


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype`` -> the cache's storage dtype (``auto``: the model's dtype)."""
    if name == "auto":
        return model_dtype
    if name == "bfloat16":
        return torch.bfloat16
    if name == "int8":
        return torch.int8
    raise ValueError(f"kv_cache_dtype={name!r} is not supported: use one of "
                     f"{', '.join(KV_CACHE_DTYPES)} (auto = the model's dtype)")


def is_quantized(cache: torch.Tensor) -> bool:
    """An int8 cache (values and packed scales) rather than a float one."""
    return cache.dtype == torch.int8


def group_size(head_dim: int) -> int:
    """Channels per scale: 32, or the whole row when head_dim is no multiple of 32."""
    return GROUP if head_dim % GROUP == 0 else head_dim


def row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row in the cache: the values, plus the scales' bytes."""
    if kv_dtype != torch.int8:
        return head_dim
    return head_dim + SCALE_BYTES * (head_dim // group_size(head_dim))


def bytes_per_token_head(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one K (or V) row of one KV head, scales included."""
    return row_width(head_dim, kv_dtype) * torch.empty((), dtype=kv_dtype).element_size()


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] float -> packed int8 rows [..., D + 4 * D/G] (values, then the float32
    scale of each group of G = ``group_size(D)`` channels)."""
    *lead, d = x.shape
    g = group_size(d)
    xf = x.float().reshape(*lead, d // g, g)
    scale = xf.abs().amax(-1, keepdim=True).div_(_QMAX)
    # An all-zero group: any positive scale reproduces it exactly (and avoids 0/0).
    scale.clamp_(min=torch.finfo(torch.float32).tiny)
    q = torch.round(xf / scale).clamp_(-_QMAX, _QMAX).to(torch.int8).view(*lead, d)
    return torch.cat([q, scale.view(*lead, d // g).view(torch.int8)], dim=-1)


def dequantize(packed: torch.Tensor, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """packed int8 rows [..., head_dim + scales] -> values [..., head_dim] in ``dtype``
    (computed in float32)."""
    *lead, _ = packed.shape
    d, g = head_dim, group_size(head_dim)
    scale = packed[..., d:].contiguous().view(torch.float32).unsqueeze(-1)  # [..., D/G, 1]
    vals = packed[..., :d].float().view(*lead, d // g, g)
    return (vals * scale).view(*lead, d).to(dtype)


def write_slots(cache_half: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Store x [T, Hkv, D] into flat slots of one cache half (K or V) [blocks, bs, Hkv, W],
    quantizing for an int8 cache and converting for a float cache of another dtype."""
    hkv, w = cache_half.shape[-2], cache_half.shape[-1]
    rows = quantize(x) if is_quantized(cache_half) else x.to(cache_half.dtype)
    cache_half.view(-1, hkv, w).index_copy_(0, slots, rows)


def read_rows(rows: torch.Tensor, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """Cache rows as read (gathered blocks, or slices) -> float values in ``dtype``."""
    if is_quantized(rows):
        return dequantize(rows, dtype, head_dim)
    return rows if rows.dtype == dtype else rows.to(dtype)
