"""Gemma 2 and Gemma 3 (text): Gemma's ``(1 + w)`` RMSNorm, norms before and after both
attention and MLP, embeddings scaled by sqrt(hidden), GeGLU MLPs, ``query_pre_attn_scalar``,
alternating local (sliding-window) and global layers; Gemma 2's attention and final logit
soft caps; Gemma 3's per-head q/k norms and its local layers' own RoPE base."""
from __future__ import annotations

from llmtower.models.decoder import DecoderLM
from llmtower.models.layers.attention import AttentionOptions
from llmtower.models.layers.norms import gemma_rms_norm
from llmtower.models.layers.rotary import RotaryEmbedding


class Gemma2ForCausalLM(DecoderLM):
    """Gemma 2 (``Gemma2ForCausalLM``)."""

    family = "Gemma 2"
    norm = staticmethod(gemma_rms_norm)
    norm_names = {"pre_attn": "input_layernorm", "post_attn": "post_attention_layernorm",
                  "pre_mlp": "pre_feedforward_layernorm",
                  "post_mlp": "post_feedforward_layernorm"}

    def attention_options(self, i: int) -> AttentionOptions:
        c = self.config
        return AttentionOptions(
            window=self.windows[i], softcap=c.get("attn_logit_softcapping"),
            scale=float(c.get("query_pre_attn_scalar", c.head_dim)) ** -0.5,
            qk_norm=self.qk_norm, rope=self.layer_rope(i))

    def layer_rope(self, i: int) -> RotaryEmbedding:  # noqa: ARG002
        """Every layer: the config's RoPE."""
        return self.rope(self.config.rope_theta, self.config.rope_scaling)

    def embed_scale(self) -> float:
        return float(self.config.hidden_size) ** 0.5

    def logit_softcap(self) -> float | None:
        return self.config.get("final_logit_softcapping")


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model (``Gemma3ForCausalLM``): Gemma 2 plus per-head q/k norms; its
    local layers rotate with their own base (``rope_local_base_freq``, 10,000) and no
    scaling, its global ones with ``rope_theta`` and the config's scaling."""

    family = "Gemma 3"
    qk_norm = "head"

    def layer_rope(self, i: int) -> RotaryEmbedding:
        c = self.config
        types = c.layer_types or c.get("layer_types")
        local = types[i] == "sliding_attention" if types else self.windows[i] is not None
        if not local:
            return self.rope(c.rope_theta, c.rope_scaling)
        params = (c.get("rope_parameters") or {}).get("sliding_attention") or {}
        theta = params.get("rope_theta", c.get("rope_local_base_freq", 10000.0))
        return self.rope(float(theta), None)
