"""The decoder every non-Llama family is built from: embeddings, a stack of attention + MLP
(or mixture-of-experts) layers with the family's norms around them, the final norm and the
output head. A family subclasses ``DecoderLM`` and overrides the few hooks where it differs
(``models/gemma.py`` and the others); the Llama family keeps its own fused class
(``models/llama.py``), whose C decode path is an acceleration other families may adopt later.

The arithmetic follows transformers in float32 (norms in float32, residual adds, rotate-half
RoPE), up to summation order, so that greedy outputs match it token for token.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from llmtower.kernels import ops
from llmtower.kernels.fused_ops import FusedOps
from llmtower.lora.punica import LoRAStep
from llmtower.models.attention import AttentionMetadata, PagedAttention
from llmtower.models.config import ModelConfig
from llmtower.models.layers.attention import AttentionOptions, Norm, SelfAttention
from llmtower.models.layers.head import OutputHead
from llmtower.models.layers.mlp import GatedMLP
from llmtower.models.layers.norms import rms_norm
from llmtower.models.layers.rotary import RotaryEmbedding
from llmtower.models.layers.weights import StateValue, WeightTaker

Mlp = Callable[[torch.Tensor], torch.Tensor]  # a GatedMLP or a SparseMoE

# The four places a layer may normalize: before / after attention, before / after the MLP.
NORM_SLOTS = ("pre_attn", "post_attn", "pre_mlp", "post_mlp")


@dataclass
class DecoderLayer:
    """Owns one layer: its attention, its MLP and whichever of the four norms the family has
    (None where it has none)."""

    attn: SelfAttention
    mlp: Mlp
    pre_attn: torch.Tensor | None
    post_attn: torch.Tensor | None
    pre_mlp: torch.Tensor | None
    post_mlp: torch.Tensor | None


class DecoderLM:
    """Owns a decoder's weights and rotary tables; ``forward`` runs a step's flat batch.

    Hooks for families (class attributes and methods):
      ``norm_names``: HF name of each norm slot used (``NORM_SLOTS``), e.g. Llama's
      ``{"pre_attn": "input_layernorm", "pre_mlp": "post_attention_layernorm"}``;
      ``norm``: the RMSNorm flavour; ``qk_norm``: "", "head" or "full";
      ``attention_options(i)``, ``load_mlp(take, prefix, i)``, ``embed_scale()``,
      ``residual_multiplier()``, ``logit_softcap()``, ``logits_divisor()``.
    """

    supports_lora = False
    family = "decoder"
    norm_names: dict[str, str] = {"pre_attn": "input_layernorm",
                                  "pre_mlp": "post_attention_layernorm"}
    norm: Norm = staticmethod(rms_norm)
    qk_norm = ""

    def __init__(self, config: ModelConfig,
                 state_dict: Mapping[str, StateValue],
                 dtype: torch.dtype, max_position: int, quantization: str = "none") -> None:
        if quantization not in ("none", "int8", "int4"):
            raise ValueError(f"quantization={quantization!r} is not supported for "
                             f"{config.architecture}: use none, int8 or int4")
        self.config = config
        self.dtype = dtype
        self.max_position = max_position
        self.eps = config.rms_norm_eps
        self.windows = config.layer_sliding_windows()
        self._ropes: dict[tuple[float, str], RotaryEmbedding] = {}
        take = WeightTaker(state_dict, dtype, None if quantization == "none" else quantization,
                           self.family)
        c = config
        self.embed = take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.layers = [self._load_layer(take, i) for i in range(c.num_hidden_layers)]
        self.final_norm = take("model.norm.weight", (c.hidden_size,))
        if c.tie_word_embeddings or not take.has("lm_head.weight"):
            if not c.tie_word_embeddings:
                raise ValueError("the checkpoint has no lm_head.weight but tie_word_embeddings is "
                                 "false: set tie_word_embeddings=true in config.json if the "
                                 "embeddings are shared")
            plain = self.embed
        else:
            plain = take("lm_head.weight", (c.vocab_size, c.hidden_size))
        self.head = OutputHead(plain, quantization != "none", self.logit_softcap(),
                               self.logits_divisor())
        self._embed_scale = self.embed_scale()
        self._residual = self.residual_multiplier()
        self._fused = FusedOps(self.dtype) if self.dtype in (torch.float32, torch.bfloat16) \
            and ops.capabilities().can_run("fused_ops") else None
        self._fused_norms = self._fused if self._fused_layout() else None

    # ------------------------------------------------------------------ family hooks
    def attention_options(self, i: int) -> AttentionOptions:
        """Layer i's attention options: by default its sliding window and the global RoPE."""
        return AttentionOptions(window=self.windows[i], qk_norm=self.qk_norm,
                                rope=self.rope(self.config.rope_theta, self.config.rope_scaling))

    def load_mlp(self, take: WeightTaker, prefix: str, i: int) -> Mlp:  # noqa: ARG002
        """Layer i's MLP (``prefix``: ``model.layers.<i>.``)."""
        c = self.config
        return GatedMLP.load(take, prefix + "mlp.", c.hidden_size, c.intermediate_size,
                             c.hidden_act)

    def embed_scale(self) -> float:
        """What the embeddings are multiplied by (Gemma: sqrt(hidden); Granite: its multiplier)."""
        return 1.0

    def residual_multiplier(self) -> float:
        """What each sublayer's output is scaled by before its residual add (Granite)."""
        return 1.0

    def logit_softcap(self) -> float | None:
        """The final logits' soft cap (Gemma 2), None for none."""
        return None

    def logits_divisor(self) -> float:
        """What the final logits are divided by (Granite's logits_scaling)."""
        return 1.0

    # ------------------------------------------------------------------ building
    def rope(self, theta: float, scaling: dict | None) -> RotaryEmbedding:
        """The rotary tables for ``theta`` and ``scaling``, shared by the layers that use them."""
        key = (theta, repr(scaling))
        if key not in self._ropes:
            self._ropes[key] = RotaryEmbedding(self.config.head_dim, self.max_position, theta,
                                               scaling, self.dtype)
        return self._ropes[key]

    def _fused_layout(self) -> bool:
        """Whether this model's layers are Llama's (plain RMSNorm before attention and before
        the MLP only, residuals not scaled): the fused residual add + RMSNorm kernel then
        saves each norm ~6 tensor ops."""
        return type(self).norm is rms_norm and set(self.norm_names) == {"pre_attn", "pre_mlp"} \
            and self._residual == 1.0 and bool(self.layers)

    def _fused_attention(self, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                         meta: AttentionMetadata) -> FusedOps | None:
        """The fused kernels for this step's RoPE + KV writes, once the step's positions and
        slots are checked against the tables they index; None where a cache holds another
        dtype (``--kv-cache-dtype``) than the model's, or there are no fused kernels."""
        if self._fused is None or not kv_caches \
                or any(c.dtype != self.dtype for c in kv_caches):
            return None
        c0 = kv_caches[0]
        self._fused.check_step(positions, meta.slot_mapping, self.max_position,
                               c0.shape[1] * c0.shape[2])
        return self._fused

    def _load_layer(self, take: WeightTaker, i: int) -> DecoderLayer:
        c = self.config
        p = f"model.layers.{i}."
        attn = SelfAttention(take, p + "self_attn.", c.hidden_size, c.num_attention_heads,
                             c.num_key_value_heads, c.head_dim, self.attention_options(i),
                             type(self).norm, self.eps, c.attention_bias)
        norms = {slot: take(p + name + ".weight", (c.hidden_size,))
                 for slot, name in self.norm_names.items()}
        return DecoderLayer(attn, self.load_mlp(take, p, i), norms.get("pre_attn"),
                            norms.get("post_attn"), norms.get("pre_mlp"), norms.get("post_mlp"))

    # ------------------------------------------------------------------ running
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn: PagedAttention, meta: AttentionMetadata,
                logits_indices: torch.Tensor, head: bool = True,
                lora: LoRAStep | None = None) -> torch.Tensor:
        """input_ids/positions [T] -> float32 logits [len(logits_indices), vocab]; with
        ``head=False`` the final norm's rows instead (for ``greedy_tokens``)."""
        if lora is not None:
            raise ValueError(f"LoRA adapters are not supported for {self.config.architecture}")
        norm, eps, r = type(self).norm, self.eps, self._residual
        h = F.embedding(input_ids, self.embed)
        if self._embed_scale != 1.0:
            # transformers multiplies by the scale as a tensor of the model's dtype.
            h = h * torch.tensor(self._embed_scale, dtype=h.dtype)
        fa = self._fused_attention(positions, kv_caches, meta)
        if self._fused_norms is not None:
            h = self._fused_layers(self._fused_norms, fa, h, positions, kv_caches, attn, meta,
                                   logits_indices)
            return self.head.logits(h) if head else h
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = h if layer.pre_attn is None else norm(h, layer.pre_attn, eps)
            x = layer.attn(x, positions, kv_caches[i], attn, meta, fa)
            if i == last:
                # Only the rows that are sampled from need the rest of the network.
                x = x.index_select(0, logits_indices)
                h = h.index_select(0, logits_indices)
            if layer.post_attn is not None:
                x = norm(x, layer.post_attn, eps)
            h = h + (x * r if r != 1.0 else x)
            x = h if layer.pre_mlp is None else norm(h, layer.pre_mlp, eps)
            x = layer.mlp(x)
            if layer.post_mlp is not None:
                x = norm(x, layer.post_mlp, eps)
            h = h + (x * r if r != 1.0 else x)
        if not self.layers:
            h = h.index_select(0, logits_indices)
        h = norm(h, self.final_norm, eps)
        return self.head.logits(h) if head else h

    __call__ = forward

    def _fused_layers(self, fo: FusedOps, fa: FusedOps | None, h: torch.Tensor,
                      positions: torch.Tensor,
                      kv_caches: list[torch.Tensor], attn: PagedAttention,
                      meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """``forward``'s layers and final norm for Llama-layout models, each residual add
        fused into the norm that follows it (``h`` updated in place): the final norm's rows."""
        eps, layers = self.eps, self.layers
        x = fo.add_rms_norm(h, None, layers[0].pre_attn, eps)  # type: ignore[arg-type]
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            x = layer.attn(x, positions, kv_caches[i], attn, meta, fa)
            if i == last:
                # Only the rows that are sampled from need the rest of the network.
                x = x.index_select(0, logits_indices)
                h = h.index_select(0, logits_indices)
            x = fo.add_rms_norm(h, x, layer.pre_mlp, eps)  # type: ignore[arg-type]
            x = layer.mlp(x)
            nxt = layers[i + 1].pre_attn if i < last else self.final_norm
            x = fo.add_rms_norm(h, x, nxt, eps)  # type: ignore[arg-type]
        return x

    def greedy_rows(self) -> int:
        """Most sampled rows ``greedy_tokens`` takes (0: no greedy screen)."""
        return self.head.greedy_rows()

    def greedy_tokens(self, hidden: torch.Tensor, allow: np.ndarray | None = None
                      ) -> np.ndarray:
        """The argmax token of each final-norm row (``OutputHead.greedy_tokens``)."""
        return self.head.greedy_tokens(hidden, allow)
