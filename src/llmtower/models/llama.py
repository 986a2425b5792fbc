"""The Llama-family decoder (Llama, Qwen2, Mistral, SmolLM) over a flat batch of tokens.

A step's tokens from many requests (prefill chunks and decodes mixed) form one ``[T]`` batch:
every linear layer runs once over all T rows; only attention looks at which request a row
belongs to (``PagedAttention`` with the step's ``AttentionMetadata``).

The arithmetic follows Hugging Face transformers (RMSNorm in float32, ``x * rsqrt(mean(x^2) +
eps)`` then ``weight *``; residual adds; RoPE in the rotate-half form; float32 logits), up to
summation order and fused multiply-adds, so that greedy outputs match it token for token. The q/k/v projections are fused into one
matrix (one GEMM); SiLU and the gate * up product run inside the up projection's GEMM
(``models/linear.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmtower.models.attention import AttentionMetadata, PagedAttention
from llmtower.models.config import ModelConfig
from llmtower.models.linear import linear, silu_mul
from llmtower.models.rope import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: computed in float32, scaled by the weight in x's dtype."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


@dataclass
class DecoderLayerWeights:
    """Owns one decoder layer's tensors (q/k/v fused into one matrix)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 * Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class LlamaForCausalLM:
    """Owns the weights of a Llama-family model and its rotary tables; ``forward`` runs one
    step's flat batch through every layer and returns logits for the rows asked for."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor],
                 dtype: torch.dtype, max_position: int) -> None:
        self.config = config
        self.dtype = dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        take = _Taker(state_dict, dtype)
        self.embed = take("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))
        self.layers = [self._load_layer(take, i) for i in range(config.num_hidden_layers)]
        self.norm = take("model.norm.weight", (config.hidden_size,))
        if config.tie_word_embeddings or "lm_head.weight" not in state_dict:
            if not config.tie_word_embeddings:
                raise ValueError("the checkpoint has no lm_head.weight but tie_word_embeddings is "
                                 "false: set tie_word_embeddings=true in config.json if the "
                                 "embeddings are shared")
            self.lm_head = self.embed
        else:
            self.lm_head = take("lm_head.weight", (config.vocab_size, config.hidden_size))
        self.rope = RotaryEmbedding(self.head_dim, max_position, config.rope_theta,
                                    config.rope_scaling, dtype)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

    def _load_layer(self, take: "_Taker", i: int) -> DecoderLayerWeights:
        c = self.config
        p = f"model.layers.{i}."
        hd, h, hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        q = take(p + "self_attn.q_proj.weight", (h * hd, c.hidden_size))
        k = take(p + "self_attn.k_proj.weight", (hkv * hd, c.hidden_size))
        v = take(p + "self_attn.v_proj.weight", (hkv * hd, c.hidden_size))
        qkv_bias = None
        if c.attention_bias or take.has(p + "self_attn.q_proj.bias"):
            qkv_bias = torch.cat([take(p + f"self_attn.{n}_proj.bias", (s,))
                                  for n, s in (("q", h * hd), ("k", hkv * hd), ("v", hkv * hd))])
        # o_proj's bias differs by family (Llama with attention_bias: yes; Qwen2: no): follow
        # the weights.
        o_bias = take(p + "self_attn.o_proj.bias", (c.hidden_size,)) \
            if take.has(p + "self_attn.o_proj.bias") else None
        return DecoderLayerWeights(
            input_norm=take(p + "input_layernorm.weight", (c.hidden_size,)),
            qkv=torch.cat([q, k, v]).contiguous(), qkv_bias=qkv_bias,
            o_proj=take(p + "self_attn.o_proj.weight", (c.hidden_size, h * hd)), o_bias=o_bias,
            post_norm=take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
            gate=take(p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size)),
            up=take(p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size)),
            down=take(p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn: PagedAttention, meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T] -> float32 logits [len(logits_indices), vocab]."""
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rope.lookup(positions)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            residual = h
            x = rms_norm(h, layer.input_norm, self.eps)
            x = self._attention(x, layer, kv_caches[i], attn, meta, cos, sin)
            if i == last:
                # Only the rows that are sampled from need the rest of the network.
                x = x.index_select(0, logits_indices)
                residual = residual.index_select(0, logits_indices)
            # In place: the residual stream is this forward's own tensor (the embedding output).
            h = residual.add_(x)
            x = rms_norm(h, layer.post_norm, self.eps)
            h = h.add_(self._mlp(x, layer))
        if not self.layers:
            h = h.index_select(0, logits_indices)
        h = rms_norm(h, self.norm, self.eps)
        return linear(h, self.lm_head).float()

    __call__ = forward

    def _attention(self, x: torch.Tensor, layer: DecoderLayerWeights, kv_cache: torch.Tensor,
                   attn: PagedAttention, meta: AttentionMetadata, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = linear(x, layer.qkv, layer.qkv_bias)
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads,
                                                       self.head_dim)
        qk = self.rope.apply(qk, cos, sin)
        q = qk[:, :self.num_heads]
        k = qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        o = attn.forward(q, k, v, kv_cache, meta)
        return linear(o, layer.o_proj, layer.o_bias)

    def _mlp(self, x: torch.Tensor, layer: DecoderLayerWeights) -> torch.Tensor:
        return linear(silu_mul(x, layer.gate, layer.up), layer.down)


class _Taker:
    """Takes named tensors out of a state dict with a clear error for a missing or misshapen one."""

    def __init__(self, state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.state_dict = state_dict
        self.dtype = dtype

    def has(self, name: str) -> bool:
        return name in self.state_dict

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.state_dict.get(name)
        if t is None:
            raise ValueError(f"the checkpoint lacks tensor {name!r}: is it a complete "
                             "Llama-family (Llama, Qwen2, Mistral) checkpoint?")
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)} but config.json implies "
                             f"{shape}: the weights do not match the config")
        return t.to(self.dtype).contiguous()
