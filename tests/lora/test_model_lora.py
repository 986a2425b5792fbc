"""The model with LoRA rows against transformers + PEFT on the merged model (float32): each
adapter alone and three adapters and the base model in one step give the same greedy tokens."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from llmtower.executor.kv_cache import KVCache
from llmtower.lora.adapter import LoRAModelShape
from llmtower.lora.model_manager import LoRAModelManager
from llmtower.lora.request import LoRARequest
from llmtower.models.attention import AttentionMetadata, PagedAttention, PrefillSeq
from llmtower.models.llama import LlamaForCausalLM
from llmtower.models.loader import load_model_config, load_state_dict
from tests.fixtures.lora_adapters import merged_greedy

PROMPTS = [[5, 77, 300, 12, 9, 450], [33, 1, 101, 222, 333], [444, 17, 64, 128, 256, 511, 3],
           [40, 41, 42, 43]]
NEW_TOKENS = 6


def greedy_recompute(model_dir: Path, adapters: list[Path | None], prompts: list[list[int]],
                     n: int) -> list[list[int]]:
    """Greedy tokens of all prompts together, each step one prefill of every sequence (the
    step mixes the rows of every adapter), prompt i running with adapters[i]."""
    cfg = load_model_config(model_dir)
    dtype = torch.float32
    model = LlamaForCausalLM(cfg, load_state_dict(model_dir, dtype), dtype, max_position=256)
    mgr = LoRAModelManager(LoRAModelShape.from_config(cfg), dtype, max_loras=4,
                           max_cpu_loras=4, max_lora_rank=16)
    ids = []
    for k, a in enumerate(adapters):
        if a is None:
            ids.append(0)
        else:
            mgr.load(LoRARequest(f"a{k}", k + 1, str(a)))
            ids.append(k + 1)
    kv = KVCache(cfg, num_blocks=256, num_cpu_blocks=0, block_size=4, dtype=dtype)
    attn = PagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 4,
                          dtype, gather_buffer_blocks=64)
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        lens = [len(s) for s in seqs]
        starts = np.cumsum([0] + lens[:-1])
        total = sum(lens)
        meta = AttentionMetadata(total, torch.arange(total),
                                 prefills=[PrefillSeq(int(s), n_, 0) for s, n_ in zip(starts, lens)])
        positions = torch.cat([torch.arange(x) for x in lens])
        rows = np.repeat(np.array(ids, dtype=np.int64), lens)
        last = torch.tensor(starts + np.array(lens) - 1)
        logits = model(torch.tensor(sum(seqs, [])), positions, kv.kv_caches, attn, meta, last,
                       lora=mgr.step(rows))
        for s, t in zip(seqs, logits.argmax(-1).tolist()):
            s.append(t)
    return [s[len(p):] for s, p in zip(seqs, prompts)]


@pytest.mark.parametrize("which", ["all", "attn", "mlp"])
def test_each_adapter_alone_matches_merged_peft(which, tiny_llama_dir, tiny_adapters):
    path = tiny_adapters[which]
    ours = greedy_recompute(tiny_llama_dir, [path] * 2, PROMPTS[:2], NEW_TOKENS)
    ref = merged_greedy(tiny_llama_dir, path, PROMPTS[:2], NEW_TOKENS)
    assert ours == ref
    # The adapter changes the outputs (else the test could not fail).
    assert ours != merged_greedy(tiny_llama_dir, None, PROMPTS[:2], NEW_TOKENS)


def test_three_adapters_and_base_in_one_step(tiny_llama_dir, tiny_adapters):
    adapters = [tiny_adapters["all"], None, tiny_adapters["attn"], tiny_adapters["mlp"]]
    ours = greedy_recompute(tiny_llama_dir, adapters, PROMPTS, NEW_TOKENS)
    for k, (a, p) in enumerate(zip(adapters, PROMPTS)):
        assert ours[k] == merged_greedy(tiny_llama_dir, a, [p], NEW_TOKENS)[0], k


def test_base_rows_unchanged_by_lora_rows(tiny_llama_dir, tiny_adapters):
    """A row without an adapter gives the same logits beside adapter rows as alone."""
    alone = greedy_recompute(tiny_llama_dir, [None], PROMPTS[1:2], NEW_TOKENS)
    mixed = greedy_recompute(tiny_llama_dir, [tiny_adapters["all"], None], PROMPTS[:2],
                             NEW_TOKENS)
    assert mixed[1] == alone[0]
