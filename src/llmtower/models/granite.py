"""Granite (3.x dense): Llama's layers with four multipliers: the embeddings
(``embedding_multiplier``), each sublayer's residual contribution (``residual_multiplier``),
the attention scores (``attention_multiplier`` instead of 1/sqrt(head_dim)) and the logits
(divided by ``logits_scaling``)."""
from __future__ import annotations

from llmtower.models.decoder import DecoderLM
from llmtower.models.layers.attention import AttentionOptions


class GraniteForCausalLM(DecoderLM):
    """Granite (``GraniteForCausalLM``)."""

    family = "Granite"

    def attention_options(self, i: int) -> AttentionOptions:
        opt = super().attention_options(i)
        opt.scale = float(self.config.get("attention_multiplier", self.config.head_dim ** -0.5))
        return opt

    def embed_scale(self) -> float:
        return float(self.config.get("embedding_multiplier", 1.0))

    def residual_multiplier(self) -> float:
        return float(self.config.get("residual_multiplier", 1.0))

    def logits_divisor(self) -> float:
        return float(self.config.get("logits_scaling", 1.0))
