"""OLMo 3: OLMo 2's layers, three in four attending over a sliding window (``layer_types``);
the windowed layers rotate without the config's RoPE scaling (``rope_parameters`` per layer
type), the global ones with it."""
from __future__ import annotations

from llmtower.models.layers.attention import AttentionOptions
from llmtower.models.olmo2 import Olmo2ForCausalLM


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3 (``Olmo3ForCausalLM``)."""

    family = "OLMo 3"

    def attention_options(self, i: int) -> AttentionOptions:
        opt = super().attention_options(i)
        if self.windows[i] is not None:  # a local layer: its own (unscaled) RoPE
            c = self.config
            local = (c.get("rope_parameters") or {}).get("sliding_attention") or {}
            opt.rope = self.rope(float(local.get("rope_theta", c.rope_theta)), None)
        return opt
