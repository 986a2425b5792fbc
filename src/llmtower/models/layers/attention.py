"""One layer's self-attention over the paged cache: the fused q/k/v projection, optional q/k
norms, the rotary embedding, ``PagedAttention`` (with the layer's window, soft cap, sinks and
scale) and the output projection."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmtower.kernels.fused_ops import FusedOps
from llmtower.models.attention import AttentionMetadata, PagedAttention
from llmtower.models.layers.rotary import RotaryEmbedding
from llmtower.models.layers.weights import Weight, WeightTaker, apply_linear, fuse, packed

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass
class AttentionOptions:
    """What differs between families' attention layers. ``qk_norm``: "" none, "head" each
    head's query and key normalized (Qwen3, Gemma 3), "full" the whole q and k projections
    (OLMo 2, OLMoE); ``rope`` None: no rotary embedding on this layer (SmolLM3's NoPE layers);
    ``clip_qkv``: OLMoE's clamp of the projections; ``sinks``: the layer has gpt-oss's
    per-head attention sink logits (``self_attn.sinks``)."""

    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    qk_norm: str = ""
    rope: RotaryEmbedding | None = None
    clip_qkv: float | None = None
    sinks: bool = False


class SelfAttention:
    """Owns one layer's attention matrices (q/k/v fused into one) and its options."""

    def __init__(self, take: WeightTaker, prefix: str, hidden: int, heads: int, kv_heads: int,
                 head_dim: int, options: AttentionOptions, norm: Norm, eps: float,
                 bias: bool = False) -> None:
        self.h, self.hkv, self.d = heads, kv_heads, head_dim
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.opt = options
        self.norm, self.eps = norm, eps
        p = prefix
        self.qkv: Weight = packed(fuse([
            take.linear(p + "q_proj.weight", (self.q_size, hidden)),
            take.linear(p + "k_proj.weight", (self.kv_size, hidden)),
            take.linear(p + "v_proj.weight", (self.kv_size, hidden))]))
        self.qkv_bias = None
        if bias or take.has(p + "q_proj.bias"):
            self.qkv_bias = torch.cat([take(p + "q_proj.bias", (self.q_size,)),
                                       take(p + "k_proj.bias", (self.kv_size,)),
                                       take(p + "v_proj.bias", (self.kv_size,))])
        self.o_proj: Weight = packed(fuse([take.linear(p + "o_proj.weight", (hidden, self.q_size))]))
        self.o_bias = take.optional(p + "o_proj.bias", (hidden,))
        # Sink logits [H]: PagedAttention adds them as a softmax column.
        self.sinks = take(p + "sinks", (heads,)) if options.sinks else None
        self.q_norm = self.k_norm = None
        if options.qk_norm:
            head = options.qk_norm == "head"
            self.q_norm = take(p + "q_norm.weight", (head_dim if head else self.q_size,))
            self.k_norm = take(p + "k_norm.weight", (head_dim if head else self.kv_size,))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                 attn: PagedAttention, meta: AttentionMetadata,
                 fused: FusedOps | None = None) -> torch.Tensor:
        """The layer's attention output for x [T, hidden]. ``fused``: the step's fused kernels,
        given once their indices were checked (``FusedOps.check_step``) and where the cache
        holds the model's dtype: RoPE and the KV write then run in one C call on layers
        without q/k norms or clipping."""
        t = x.shape[0]
        qkv = apply_linear(x, self.qkv, self.qkv_bias)
        rope = self.opt.rope
        if fused is not None and rope is not None and self.q_norm is None \
                and self.opt.clip_qkv is None:
            cos, sin = rope.tables()
            # Only fresh prefills (SDPA over the chunk's own keys) read k beside the cache.
            want_k = any(p.num_computed == 0 for p in meta.prefills)
            q, k = fused.rope_kv_write(qkv, self.h, self.hkv, self.d, cos, sin, positions,
                                       meta.slot_mapping, kv_cache, want_k)
            v = qkv[:, self.q_size + self.kv_size:].view(t, self.hkv, self.d)
            o = attn.forward(q, k, v, kv_cache, meta, kv_written=True,
                             sliding_window=self.opt.window, logit_softcap=self.opt.softcap,
                             scale=self.opt.scale, sinks=self.sinks)
            return apply_linear(o, self.o_proj, self.o_bias)
        q = qkv[:, :self.q_size]
        k = qkv[:, self.q_size:self.q_size + self.kv_size]
        v = qkv[:, self.q_size + self.kv_size:].reshape(t, self.hkv, self.d)
        if self.q_norm is not None and self.k_norm is not None and self.opt.qk_norm == "full":
            q, k = self.norm(q, self.q_norm, self.eps), self.norm(k, self.k_norm, self.eps)
        c = self.opt.clip_qkv
        if c is not None:  # after the norms, as OLMoE does
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q, k = q.reshape(t, self.h, self.d), k.reshape(t, self.hkv, self.d)
        if self.q_norm is not None and self.k_norm is not None and self.opt.qk_norm == "head":
            q, k = self.norm(q, self.q_norm, self.eps), self.norm(k, self.k_norm, self.eps)
        if rope is not None:
            cos, sin = rope.lookup(positions)
            q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        o = attn.forward(q.contiguous(), k.contiguous(), v, kv_cache, meta,
                         sliding_window=self.opt.window, logit_softcap=self.opt.softcap,
                         scale=self.opt.scale, sinks=self.sinks)
        return apply_linear(o, self.o_proj, self.o_bias)
