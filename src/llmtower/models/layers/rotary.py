"""Rotary position embeddings (RoPE): plain, and the scaled variants of long-context models
(``rope_type`` llama3, linear, dynamic, yarn, and longrope with one set of explicit
per-frequency factors: what a GGUF's ``rope_freqs`` tensor holds).

The cos/sin tables are computed once for every position up to ``max_position`` with exactly the
float32 formulas of Hugging Face transformers (``position * inv_freq``, then ``cos``/``sin``), so
a token's rotation does not depend on the step or the batch it is computed in.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_position: int = 0) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] float32, the factor cos and sin are scaled by).

    ``scaling``: None or a dict with ``rope_type`` and its parameters (``models/config.py``
    normalizes them). ``max_position``: the longest context served, which fixes ``dynamic``'s
    base once (transformers recomputes it as a sequence grows, which a paged cache whose keys
    were rotated earlier cannot follow; within ``max_position_embeddings`` both are plain RoPE).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    assert scaling is not None
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, scaling), 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "dynamic":
        return _dynamic_ntk(head_dim, theta, scaling, max_position), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    if rope_type == "longrope":
        return (divide_frequencies(inv_freq, scaling["short_factor"]),
                float(scaling.get("attention_factor", 1.0)))
    raise ValueError(f"rope scaling type {rope_type!r} is not supported: use one of "
                     f"{', '.join(ROPE_TYPES)}")


def divide_frequencies(inv_freq: torch.Tensor, factors: Sequence[float]) -> torch.Tensor:
    """Each inverse frequency divided by its own factor (one per rotary pair, as llama.cpp's
    ``rope_freqs`` and LongRoPE's factors give them). Dividing the plain frequencies (where
    transformers' longrope computes ``1 / (factor * base ** x)``) gives, for the frequencies
    llama3 keeps or divides by its whole ``factor``, bit for bit the Llama 3 original's values;
    the blended band is within a float32 rounding."""
    f = torch.as_tensor(factors, dtype=torch.float32)
    if f.shape != inv_freq.shape:
        raise ValueError(f"rope scaling has {f.numel()} per-frequency factors but the head "
                         f"has {inv_freq.numel()} rotary frequencies (head_dim / 2)")
    if not bool(torch.isfinite(f).all()) or bool((f <= 0).any()):
        raise ValueError("rope scaling's per-frequency factors must be finite and positive")
    return inv_freq / f


def _llama3_scaling(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the band in
    # between interpolated smoothly.
    factor = s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _dynamic_ntk(dim: int, theta: float, s: dict[str, Any], max_position: int) -> torch.Tensor:
    # NTK-aware: the base grows with the served length past the trained one.
    trained = s["max_position_embeddings"]
    seq_len = max(max_position, trained)
    factor = s["factor"]
    base = theta * ((factor * seq_len / trained) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(dim: int, theta: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    # YaRN: interpolate the low frequencies, keep the high ones, ramp between them; cos and sin
    # scaled by the attention factor.
    factor = s["factor"]
    old_len = s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """Owns the cos/sin tables and applies the "rotate half" rotation of transformers,
    ``q * cos + rotate_half(q) * sin`` with ``rotate_half(q) = cat(-q2, q1)``, written as
    ``addcmul(q * cos, cat(q2, q1), cat(-sin, sin))``: three tensor ops instead of seven, and
    3x faster on long prefills; the result may differ from transformers' in the last bit where
    the CPU fuses the multiply-add."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None, dtype: torch.dtype) -> None:
        inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling, max_position)
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        # Half-width tables, as transformers computes them (and tests compare).
        self.cos = cos.to(dtype)
        self.sin = sin.to(dtype)
        self._cos = torch.cat([cos, cos], dim=-1).to(dtype)
        self._sin_signed = torch.cat([-sin, sin], dim=-1).to(dtype)
        self.half = head_dim // 2

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-width tables [max_position, head_dim]: cat(cos, cos) and cat(-sin, sin)."""
        return self._cos, self._sin_signed

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for ``positions`` [T], shaped [T, 1, head_dim] to broadcast over heads."""
        return self._cos[positions].unsqueeze(1), self._sin_signed[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, heads, head_dim]; returns a new contiguous tensor."""
        swapped = torch.cat((x[..., self.half:], x[..., :self.half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin)
