"""One stream's decode speed on a synthetic mixture-of-experts model against dense models with
the same active parameters: does the MoE block (route, group by expert, one GEMM per active
expert: models/layers/moe.py) cost what its active weights cost?

The MoE is Mixtral-shaped (``MixtralForCausalLM``): hidden 1024, 32 experts of intermediate
512, 4 active per token, 16:4 heads of 64, ``--layers`` layers, vocabulary 32,000. The dense
models have one MLP of intermediate 4 x 512 = 2048 (the same active MLP weights) and the same
attention, embeddings and head:

- ``dense (same path)``: the same generic decoder (models/decoder.py) without experts, so the
  ratio isolates the MoE block;
- ``dense (Llama fused)``: ``LlamaForCausalLM`` with its fused C decode path, the fastest way
  llmtower runs a dense model.

Random weights, no files: each model is built in this process, prefilled with ``--context``
tokens, then decodes ``--steps`` tokens one at a time by direct forward calls (the paged C
attention kernel, greedy screen off: full logits each step). The variants take turns over
``--rounds`` and, within a round, step by step (so that a shared machine's changing load hits
them alike); the medians of the per-round decode tok/s are printed with the MoE's speed as a
fraction of each (the target: >= 0.8x the dense models; the fused Llama path is the stricter
comparison, the same generic path isolates the MoE block), and the load average.

    .venv/bin/python benchmarks/moe_vs_dense.py
    .venv/bin/python benchmarks/moe_vs_dense.py --dtype float32 --layers 2 --steps 32
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from llmtower.executor.kv_cache import KVCache
from llmtower.models.attention import AttentionMetadata, PagedAttention, PrefillSeq, decode_batch
from llmtower.models.config import ModelConfig
from llmtower.models.decoder import DecoderLM
from llmtower.models.interface import CausalLM
from llmtower.models.llama import LlamaForCausalLM
from llmtower.models.moe import MixtralForCausalLM

HIDDEN, EXPERTS, ACTIVE, EXPERT_SIZE, VOCAB = 1024, 32, 4, 512, 32000
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 4, 64, 16


def _config(arch: str, layers: int, intermediate: int) -> ModelConfig:
    raw = {"num_local_experts": EXPERTS, "num_experts_per_tok": ACTIVE}
    return ModelConfig(arch, VOCAB, HIDDEN, intermediate, layers, HEADS, KV_HEADS, HEAD_DIM,
                       max_position_embeddings=4096, raw=raw)


def _weights(layers: int, moe: bool, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    s = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "lm_head.weight": w(VOCAB, HIDDEN),
         "model.norm.weight": torch.ones(HIDDEN, dtype=dtype)}
    for i in range(layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=dtype)
        s[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=dtype)
        for n, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            s[p + f"self_attn.{n}_proj.weight"] = w(rows * HEAD_DIM, HIDDEN)
        s[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
        if moe:
            m = p + "block_sparse_moe."
            s[m + "gate.weight"] = w(EXPERTS, HIDDEN)
            for e in range(EXPERTS):
                s[m + f"experts.{e}.w1.weight"] = w(EXPERT_SIZE, HIDDEN)
                s[m + f"experts.{e}.w3.weight"] = w(EXPERT_SIZE, HIDDEN)
                s[m + f"experts.{e}.w2.weight"] = w(HIDDEN, EXPERT_SIZE)
        else:
            inter = ACTIVE * EXPERT_SIZE
            s[p + "mlp.gate_proj.weight"] = w(inter, HIDDEN)
            s[p + "mlp.up_proj.weight"] = w(inter, HIDDEN)
            s[p + "mlp.down_proj.weight"] = w(HIDDEN, inter)
    return s


class Stream:
    """One model with its own paged cache, decoding one request."""

    def __init__(self, model: CausalLM, config: ModelConfig, dtype: torch.dtype, max_len: int) -> None:
        self.model = model
        blocks = -(-max_len // BLOCK)
        self.kv = KVCache(config, num_blocks=blocks + 1, num_cpu_blocks=0, block_size=BLOCK,
                          dtype=dtype)
        self.attn = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype, blocks + 1)
        self.table = np.arange(blocks + 1, dtype=np.int64)[None, :]

    def prefill(self, context: int) -> None:
        """Prefill ``context`` random tokens (rewriting the same slots each round)."""
        ids = torch.randint(3, VOCAB, (context,))
        meta = AttentionMetadata(context, torch.arange(context),
                                 prefills=[PrefillSeq(0, context, 0)])
        one = torch.tensor([context - 1])
        logits = self.model(ids, torch.arange(context), self.kv.kv_caches, self.attn, meta, one)
        self.token = int(logits.argmax())

    def step(self, pos: int) -> float:
        """Decode the token at ``pos``; the seconds it took."""
        start = time.perf_counter()
        meta = AttentionMetadata(1, torch.tensor([pos]))
        meta.decodes = decode_batch(self.table, np.array([pos + 1]), BLOCK)
        logits = self.model(torch.tensor([self.token]), torch.tensor([pos]), self.kv.kv_caches,
                            self.attn, meta, torch.tensor([0]))
        self.token = int(logits.argmax())
        return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    max_len = a.context + a.steps + 1
    dense_inter = ACTIVE * EXPERT_SIZE
    moe_cfg = _config("MixtralForCausalLM", a.layers, EXPERT_SIZE)
    dense_cfg = _config("LlamaForCausalLM", a.layers, dense_inter)
    streams = {
        "moe (32 experts, 4 active)": Stream(MixtralForCausalLM(
            moe_cfg, _weights(a.layers, True, dtype, 0), dtype, max_len), moe_cfg, dtype, max_len),
        "dense (same path)": Stream(DecoderLM(
            dense_cfg, _weights(a.layers, False, dtype, 1), dtype, max_len), dense_cfg, dtype,
            max_len),
        "dense (Llama fused)": Stream(LlamaForCausalLM(
            dense_cfg, _weights(a.layers, False, dtype, 1), dtype, max_len), dense_cfg, dtype,
            max_len),
    }
    results: dict[str, list[float]] = {k: [] for k in streams}
    for _ in range(a.rounds):
        for s in streams.values():  # each round rewrites the same slots
            s.prefill(a.context)
        spent = dict.fromkeys(streams, 0.0)
        # The variants take turns step by step, so that a shared machine's load changes hit
        # them alike.
        for pos in range(a.context, a.context + a.steps):
            for name, s in streams.items():
                spent[name] += s.step(pos)
        for name in streams:
            results[name].append(a.steps / spent[name])
    active = 3 * HIDDEN * EXPERT_SIZE * ACTIVE
    print(f"{a.dtype}, {a.layers} layers, hidden {HIDDEN}, context {a.context}, {a.steps} decode "
          f"steps, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; active MLP "
          f"weights per layer {active / 1e6:.1f} M (MoE total {3 * HIDDEN * EXPERT_SIZE * EXPERTS / 1e6:.1f} M)")
    moe = statistics.median(results["moe (32 experts, 4 active)"])
    for name, r in results.items():
        m = statistics.median(r)
        print(f"  {name:28s} {m:8.1f} tok/s   MoE / this: {moe / m:.2f}x   rounds "
              + " ".join(f"{x:.1f}" for x in r))


if __name__ == "__main__":
    main()
