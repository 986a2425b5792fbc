"""SmolLM3: Llama's layers, where every fourth one (``no_rope_layers[i] == 0``) attends
without a rotary embedding (NoPE)."""
from __future__ import annotations

from llmtower.models.decoder import DecoderLM
from llmtower.models.layers.attention import AttentionOptions


class SmolLM3ForCausalLM(DecoderLM):
    """SmolLM3 (``SmolLM3ForCausalLM``)."""

    family = "SmolLM3"

    def attention_options(self, i: int) -> AttentionOptions:
        opt = super().attention_options(i)
        c = self.config
        uses_rope = c.get("no_rope_layers")
        if uses_rope is None:  # transformers' default: every interval-th layer without
            interval = int(c.get("no_rope_layer_interval", 4))
            uses_rope = [int((j + 1) % interval != 0) for j in range(c.num_hidden_layers)]
        if len(uses_rope) != c.num_hidden_layers:
            raise ValueError(f"no_rope_layers has {len(uses_rope)} entries but the model has "
                             f"{c.num_hidden_layers} layers: one per layer")
        if not uses_rope[i]:
            opt.rope = None
        return opt
