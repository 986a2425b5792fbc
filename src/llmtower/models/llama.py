"""The Llama-family decoder (Llama, Qwen2, Qwen3, Mistral, SmolLM) over a flat batch of tokens.

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

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from llmtower.kernels import ops
from llmtower.kernels.fused_ops import FusedOps
from llmtower.kernels.gemm_f32 import GemmF32Weight
from llmtower.kernels.gemv_bf16 import GemvWeight
from llmtower.kernels import decode_layer as decode_layer_mod
from llmtower.kernels.decode_layer import DecodeLayers, EndParts, LayerParts
from llmtower.kernels import quant_layer
from llmtower.kernels.quant_layer import QuantDecodeLayers, QuantLayerParts
from llmtower.models import lora_layers
from llmtower.lora.punica import LoRAStep
from llmtower.models.attention import AttentionMetadata, PagedAttention
from llmtower.models.config import ModelConfig
from llmtower.models import linear as linear_mod
from llmtower.models.layers.head import LM_HEAD_QUANTIZED_MAX_ROWS, OutputHead
from llmtower.models.layers.norms import rms_norm
from llmtower.models.layers.weights import (StateValue, Weight, WeightTaker, apply_linear, embed,
                                            fuse, packed)
from llmtower.models.linear import PackedWeight, linear, prepack_gate_up, silu_mul
from llmtower.models.quant import QuantizedLinear
from llmtower.models import quant_block
from llmtower.models.quant_block import BlockEmbedding, BlockQuantLinear
from llmtower.models.layers.rotary import RotaryEmbedding

# Names other modules import from here.
__all__ = ["LlamaForCausalLM", "DecoderLayerWeights", "apply_linear", "rms_norm",
           "LM_HEAD_QUANTIZED_MAX_ROWS"]


@dataclass
class DecoderLayerWeights:
    """Owns one decoder layer's tensors (q/k/v fused into one matrix). Quantized layers hold
    ``QuantizedLinear``s and fuse gate and up into one matrix (``gate_up``) instead."""

    input_norm: torch.Tensor
    qkv: Weight  # [(H + 2 * Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: Weight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor | PackedWeight | None
    up: torch.Tensor | PackedWeight | None
    down: Weight
    gate_up: QuantizedLinear | BlockQuantLinear | None = None  # [2 * intermediate, hidden]
    q_norm: torch.Tensor | None = None  # [D]: Qwen3's per-head RMSNorm of queries (qk_norm)
    k_norm: torch.Tensor | None = None  # [D]: and of keys


class LlamaForCausalLM:
    """Owns the weights of a Llama-family model and its rotary tables; ``forward`` runs one
    step's flat batch through every layer and returns logits for the rows asked for."""

    supports_lora = True

    def __init__(self, config: ModelConfig, state_dict: Mapping[str, StateValue],
                 dtype: torch.dtype, max_position: int, quantization: str = "none") -> None:
        if quantization not in ("none", "int8", "int4", "gguf"):
            raise ValueError(f"quantization={quantization!r} is not one of none, int8, int4, gguf")
        self.config = config
        self.dtype = dtype
        # Linear weights are kept quantized when the state dict holds quantized ones (gguf) or
        # when asked to quantize float ones (int8 / int4); the embeddings stay float.
        self.quantization = quantization
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.windows = config.layer_sliding_windows()  # per layer; None: global
        take = WeightTaker(state_dict, dtype, quantization if quantization in ("int8", "int4") else None)
        # A GGUF's embeddings in a block format stay so (rows dequantized per lookup).
        self.embed = take.embedding("model.embed_tokens.weight",
                                    (config.vocab_size, config.hidden_size))
        self.layers = [self._load_layer(take, i) for i in range(config.num_hidden_layers)]
        self.norm = take("model.norm.weight", (config.hidden_size,))
        if config.tie_word_embeddings or "lm_head.weight" not in state_dict:
            if not config.tie_word_embeddings:
                raise ValueError("the checkpoint has no lm_head.weight but tie_word_embeddings is "
                                 "false: set tie_word_embeddings=true in config.json if the "
                                 "embeddings are shared")
            self.lm_head: Weight = self.embed.linear if isinstance(self.embed, BlockEmbedding) \
                else self.embed
        else:
            self.lm_head = take.output("lm_head.weight", (config.vocab_size, config.hidden_size))
        assert isinstance(self.lm_head, (torch.Tensor, BlockQuantLinear))
        self.head = OutputHead(self.lm_head, quantized=quantization != "none")
        # The head's layouts under the names the fused decode path and tests read.
        self.lm_head = self.head.weight
        self.lm_head_dense = self.head.dense
        self.greedy_head = self.head.greedy
        self.rope = RotaryEmbedding(self.head_dim, max_position, config.rope_theta,
                                    config.rope_scaling, dtype)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.max_position = max_position
        # The fused C kernels for RMSNorm (+ residual), RoPE + KV write and SiLU * up: three
        # calls per layer where the torch code below makes ~20; the torch code stays as the
        # fallback where no C compiler exists (and for other dtypes).
        self.fused: FusedOps | None = None
        if dtype in (torch.float32, torch.bfloat16) and ops.capabilities().can_run("fused_ops"):
            self.fused = FusedOps(dtype)
        # Decode steps whose products take a decode-step kernel (up to a few hundred rows):
        # everything between two attentions in one C call per layer
        # (kernels/decode_layer.c), where every matrix has that kernel's copy.
        self.decode_layers = self._decode_layers() if self.fused is not None else None

    def _decode_layers(self) -> DecodeLayers | QuantDecodeLayers | None:
        """The fused decode layer's view of the weights, where it can run (bfloat16 or
        float32 float weights with the decode-step kernel's copies; float32 steps over GGUF
        block weights), else None."""
        if self.quantization == "gguf":
            return self._quant_decode_layers()
        if len(self.layers) < 2 or self.head_dim % 2 \
                or ops.capabilities().why_not_in("decode_layer", self.dtype) is not None \
                or self.config.qk_norm:  # the C layer has no step for Qwen3's q/k norms
            return None
        kernel = GemvWeight if self.dtype == torch.bfloat16 else GemmF32Weight
        parts = []
        for cur, nxt in zip(self.layers, self.layers[1:]):
            mats = (cur.o_proj, cur.gate, cur.down, nxt.qkv)
            gemv = [m.gemv for m in mats if type(m) is PackedWeight]
            few_row = [g for g in gemv if isinstance(g, kernel)]
            if len(few_row) < 4 or not few_row[1].silu_pair:
                return None
            o, gate, down, qkv = few_row
            parts.append(LayerParts(o, cur.o_bias, cur.post_norm, gate, down, nxt.input_norm,
                                    qkv, nxt.qkv_bias))
        # The step's two ends (DecodeLayers.step): layer 0's norm and qkv, the last layer's
        # rest, the final norm and the output layer where linear() takes its decode-kernel
        # copy (else the output layer stays with _logits).
        first, last = self.layers[0], self.layers[-1]
        ends = None
        end_mats = [m.gemv for m in (first.qkv, last.o_proj, last.gate, last.down)
                    if type(m) is PackedWeight and isinstance(m.gemv, kernel)]
        if len(end_mats) == 4 and end_mats[2].silu_pair:
            head = self.lm_head.gemv if type(self.lm_head) is PackedWeight else None
            ends = EndParts(first.input_norm, end_mats[0], first.qkv_bias, end_mats[1],
                            last.o_bias, last.post_norm, end_mats[2], end_mats[3], self.norm,
                            head if isinstance(head, kernel) and head.path == 0 else None)
        c = self.config
        return DecodeLayers(parts, c.hidden_size, c.intermediate_size, self.num_heads,
                            self.num_kv_heads, self.head_dim, self.eps, self.dtype, ends)

    def _quant_decode_layers(self) -> QuantDecodeLayers | None:
        """The fused GGUF decode layer (``kernels/quant_layer.c``) where every layer's
        products take the block kernel and the step is float32, else None."""
        c = self.config
        if self.dtype != torch.float32 or len(self.layers) < 2 or c.qk_norm or not \
                quant_layer.fits(c.hidden_size, c.intermediate_size, self.num_heads,
                                 self.head_dim):
            return None
        parts = []
        for cur, nxt in zip(self.layers, self.layers[1:]):
            o, gate_up, down, qkv = cur.o_proj, cur.gate_up, cur.down, nxt.qkv
            if not (isinstance(o, BlockQuantLinear) and isinstance(gate_up, BlockQuantLinear)
                    and isinstance(down, BlockQuantLinear) and isinstance(qkv, BlockQuantLinear)):
                return None
            parts.append(QuantLayerParts(o.parts, cur.o_bias, cur.post_norm, gate_up.parts,
                                         down.parts, nxt.input_norm, qkv.parts, nxt.qkv_bias))
        return QuantDecodeLayers(parts, c.hidden_size, c.intermediate_size, self.num_heads,
                                 self.num_kv_heads, self.head_dim, self.eps)

    def _kernel_rows(self) -> int:
        """Most rows for which every product of a step takes a decode-step kernel
        (``models/linear.py``'s dispatch), whose sums the fused decode layer repeats: float32
        gemm_f32; bfloat16 the few-row kernel, and above it gemm_bf16 (the same sums)."""
        if isinstance(self.decode_layers, QuantDecodeLayers):
            return quant_block.BLOCK_KERNEL_MAX_ROWS
        if self.dtype != torch.bfloat16:
            return linear_mod.F32_KERNEL_MAX_ROWS
        if not ops.capabilities().can_run("gemm_bf16"):
            return linear_mod.GEMV_MAX_ROWS
        return max(linear_mod.GEMV_MAX_ROWS, linear_mod.BF16_KERNEL_MAX_ROWS)

    def _load_layer(self, take: WeightTaker, i: int) -> DecoderLayerWeights:
        c = self.config
        p = f"model.layers.{i}."
        hd, h, hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        q = take.linear(p + "self_attn.q_proj.weight", (h * hd, c.hidden_size))
        k = take.linear(p + "self_attn.k_proj.weight", (hkv * hd, c.hidden_size))
        v = take.linear(p + "self_attn.v_proj.weight", (hkv * hd, c.hidden_size))
        qkv_bias = None
        if c.attention_bias or take.has(p + "self_attn.q_proj.bias"):
            qkv_bias = torch.cat([take(p + f"self_attn.{n}_proj.bias", (s,))
                                  for n, s in (("q", h * hd), ("k", hkv * hd), ("v", hkv * hd))])
        # o_proj's bias differs by family (Llama with attention_bias: yes; Qwen2: no): follow
        # the weights.
        o_bias = take(p + "self_attn.o_proj.bias", (c.hidden_size,)) \
            if take.has(p + "self_attn.o_proj.bias") else None
        gate_w = take.linear(p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size))
        up_w = take.linear(p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size))
        gate = up = fused_gate_up = None
        if isinstance(gate_w, torch.Tensor) and isinstance(up_w, torch.Tensor):
            gate, up = prepack_gate_up(gate_w, up_w)
        else:
            fused = fuse([gate_w, up_w])
            if isinstance(fused, torch.Tensor):  # a GGUF part without a block kernel: float
                gate, up = prepack_gate_up(*fused.split(c.intermediate_size))
            else:
                assert isinstance(fused, (QuantizedLinear, BlockQuantLinear))
                fused_gate_up = fused
        return DecoderLayerWeights(
            input_norm=take(p + "input_layernorm.weight", (c.hidden_size,)),
            qkv=packed(fuse([q, k, v])), qkv_bias=qkv_bias,
            o_proj=packed(fuse([take.linear(p + "self_attn.o_proj.weight",
                                              (c.hidden_size, h * hd))])),
            o_bias=o_bias,
            post_norm=take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
            gate=gate, up=up,
            down=packed(fuse([take.linear(p + "mlp.down_proj.weight",
                                            (c.hidden_size, c.intermediate_size))])),
            gate_up=fused_gate_up,
            q_norm=take(p + "self_attn.q_norm.weight", (hd,)) if c.qk_norm else None,
            k_norm=take(p + "self_attn.k_norm.weight", (hd,)) if c.qk_norm else None)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn: PagedAttention, meta: AttentionMetadata,
                logits_indices: torch.Tensor, head: bool = True,
                lora: LoRAStep | None = None) -> torch.Tensor:
        """input_ids/positions [T] -> float32 logits [len(logits_indices), vocab]; with
        ``head=False`` the final norm's rows [len(logits_indices), hidden] in the model's dtype
        instead (for ``greedy_tokens``). ``lora``: the step's adapter rows (None: none)."""
        # The fused RoPE kernel writes K/V in the model's dtype: a cache of another
        # (--kv-cache-dtype int8/bfloat16) takes the path where attention stores them.
        if self.fused is not None and self.layers and kv_caches[0].dtype == self.dtype:
            return self._forward_fused(self.fused, input_ids, positions, kv_caches, attn, meta,
                                       logits_indices, head, lora)
        h = embed(self.embed, input_ids, self.dtype)
        cos, sin = self.rope.lookup(positions)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            residual = h
            x = rms_norm(h, layer.input_norm, self.eps)
            x = self._attention(x, layer, kv_caches[i], attn, meta, cos, sin, lora, i)
            if i == last:
                # Only the rows that are sampled from need the rest of the network.
                x = x.index_select(0, logits_indices)
                residual = residual.index_select(0, logits_indices)
                lora = lora.select(logits_indices) if lora is not None else None
            # In place: the residual stream is this forward's own tensor (the embedding output).
            h = residual.add_(x)
            x = rms_norm(h, layer.post_norm, self.eps)
            h = h.add_(self._mlp(x, layer) if lora is None else lora_layers.mlp(lora, i, x, layer))
        if not self.layers:
            h = h.index_select(0, logits_indices)
        h = rms_norm(h, self.norm, self.eps)
        return self._logits(h) if head else h

    __call__ = forward

    def _forward_fused(self, fo: FusedOps, input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[torch.Tensor], attn: PagedAttention,
                       meta: AttentionMetadata, logits_indices: torch.Tensor,
                       head: bool = True, lora: LoRAStep | None = None) -> torch.Tensor:
        """``forward`` with the fused kernels: per layer three GEMMs (four when quantized), the
        attention and three C calls. Each residual add is fused into the RMSNorm after it."""
        c0 = kv_caches[0]
        fo.check_step(positions, meta.slot_mapping, self.max_position, c0.shape[1] * c0.shape[2])
        t = input_ids.shape[0]
        # Only fresh prefills (SDPA over the chunk's own keys) read k beside the cache.
        want_k = any(p.num_computed == 0 for p in meta.prefills)
        cos, sin = self.rope.tables()
        h = embed(self.embed, input_ids, self.dtype)  # the residual stream, updated in place
        last = len(self.layers) - 1
        # A decode step (no prefill) whose products take the decode-step kernel: layer i's
        # work after its attention through layer i + 1's qkv, RoPE and KV write in one C call
        # (bit for bit the calls below).
        dl = self.decode_layers
        # Steps with adapter rows: the C layer adds them in float32 (its LoRA hooks).
        if dl is not None and (lora is None or dl.takes_lora) and not meta.prefills \
                and t <= min(decode_layer_mod.MAX_ROWS, self._kernel_rows()):
            dl.begin_step(t, cos, sin, positions, meta.slot_mapping,
                          None if lora is None else lora.decode_rows())
        else:
            dl = None
        db = meta.decodes
        # Pure one-row decodes (the C attention kernel's case): layers 1 .. L-2 run whole in
        # C, attention included; layer 0's attention (which checks the step's tables) and the
        # last layer run as below.
        whole = dl is not None and dl.attends and attn.backend == "c" and db is not None \
            and db.query_start is None and db.num_rows == t and not meta.prefills \
            and not meta.decode_groups and last > 1 and not any(self.windows)
        if whole and isinstance(dl, DecodeLayers) and dl.whole_steps \
                and 0 < logits_indices.shape[0] <= t:
            assert db is not None
            # All of it in one C call, the output layer too where it has the decode kernel's
            # copy (bit for bit the calls below).
            out, is_logits = dl.step(h, kv_caches, db, attn.block_size, attn.scale,
                                     logits_indices, head)
            return out if is_logits or not head else self._logits(out)
        x = fo.add_rms_norm(h, None, self.layers[0].input_norm, self.eps)
        c_until = 0  # layers below this ran whole in C
        for i, layer in enumerate(self.layers):
            if i < c_until:
                continue
            if dl is None or i == 0:  # else q and v come from the fused call of layer i - 1
                qkv = apply_linear(x, layer.qkv, layer.qkv_bias)
                if lora is not None:
                    lora_layers.add_qkv(lora, i, x, qkv, self.q_size, self.kv_size)
                qkv = self._qk_norm(qkv, layer)
                q, k = fo.rope_kv_write(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                        cos, sin, positions, meta.slot_mapping, kv_caches[i],
                                        want_k)
                v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads,
                                                             self.head_dim)
            o = attn.forward(q, k, v, kv_caches[i], meta, kv_written=True,
                             sliding_window=self.windows[i])
            if dl is not None and i < last:
                q, v = dl.layer(i, h, o, kv_caches[i + 1])
                if whole and i == 0:
                    assert db is not None and db.checked  # by layer 0's attention
                    q, v = dl.attend_and_layers(1, last - 1, h, kv_caches, db.block_tables,
                                                db.context_lens, attn.block_size, attn.scale)
                    c_until = last
                continue
            x = apply_linear(o, layer.o_proj, layer.o_bias)
            if lora is not None:
                lora_layers.add_o(lora, i, o, x)
            if i == last:
                # Only the rows that are sampled from need the rest of the network.
                x = x.index_select(0, logits_indices)
                h = h.index_select(0, logits_indices)
                lora = lora.select(logits_indices) if lora is not None else None
            x = fo.add_rms_norm(h, x, layer.post_norm, self.eps)
            if lora is not None:
                x = lora_layers.mlp(lora, i, x, layer)
            elif layer.gate_up is not None:
                x = apply_linear(fo.silu_mul(layer.gate_up(x)), layer.down)
            else:
                x = self._mlp(x, layer)
            norm = self.layers[i + 1].input_norm if i < last else self.norm
            x = fo.add_rms_norm(h, x, norm, self.eps)
        return self._logits(x) if head else x

    def greedy_rows(self) -> int:
        """Most sampled rows ``greedy_tokens`` takes (0: the model has no greedy screen)."""
        return self.head.greedy_rows()

    def greedy_tokens(self, hidden: torch.Tensor, allow: np.ndarray | None = None
                      ) -> np.ndarray:
        """The final norm's rows (``forward(..., head=False)``, at most ``greedy_rows()``)
        -> int64 [rows]: the argmax of each row's logits, the first on ties, as the sampler
        takes it from ``forward``'s logits (``OutputHead.greedy_tokens``)."""
        return self.head.greedy_tokens(hidden, allow)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of the final normalized rows."""
        return self.head.logits(x)

    def _attention(self, x: torch.Tensor, layer: DecoderLayerWeights, kv_cache: torch.Tensor,
                   attn: PagedAttention, meta: AttentionMetadata, cos: torch.Tensor,
                   sin: torch.Tensor, lora: LoRAStep | None = None, i: int = 0) -> torch.Tensor:
        t = x.shape[0]
        qkv = apply_linear(x, layer.qkv, layer.qkv_bias)
        if lora is not None:
            lora_layers.add_qkv(lora, i, x, qkv, self.q_size, self.kv_size)
        qkv = self._qk_norm(qkv, layer)
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads,
                                                       self.head_dim)
        qk = self.rope.apply(qk, cos, sin)
        q = qk[:, :self.num_heads]
        k = qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        o = attn.forward(q, k, v, kv_cache, meta, sliding_window=self.windows[i])
        out = apply_linear(o, layer.o_proj, layer.o_bias)
        return lora_layers.add_o(lora, i, o, out) if lora is not None else out

    def _qk_norm(self, qkv: torch.Tensor, layer: DecoderLayerWeights) -> torch.Tensor:
        """Qwen3: each query and key head RMS-normalized with its layer's weights, in place
        in the fused q/k/v rows, before the rotary embedding (as transformers' Qwen3Attention
        does to q_proj's and k_proj's outputs)."""
        if layer.q_norm is None or layer.k_norm is None:
            return qkv
        t, h, hkv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = qkv[:, :self.q_size].view(t, h, d)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, hkv, d)
        q.copy_(rms_norm(q, layer.q_norm, self.eps))
        k.copy_(rms_norm(k, layer.k_norm, self.eps))
        return qkv

    def _mlp(self, x: torch.Tensor, layer: DecoderLayerWeights) -> torch.Tensor:
        if layer.gate_up is not None:
            y = layer.gate_up(x)
            i = y.shape[1] // 2
            return apply_linear(F.silu(y[:, :i]).mul_(y[:, i:]), layer.down)
        return linear(silu_mul(x, layer.gate, layer.up), layer.down)


