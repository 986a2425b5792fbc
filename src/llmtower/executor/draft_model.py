"""Draft-model speculation: a smaller model sharing the target's tokenizer proposes K tokens
autoregressively; the target verifies them all in one forward pass.

The draft model keeps its own paged KV cache with the *same block ids* as the target's (plus a
few scratch blocks), so it needs no block manager of its own:

- every step it runs over exactly the target's flat batch (same token ids, positions, slots
  and attention plan), so its cache holds the same positions as the target's; rejected
  drafts' positions are rewritten later, as in the target's cache;
- the scheduler's swaps, copies and relocator moves are applied to its cache too;
- to draft, each request decodes K single tokens from its last token. Positions that fall past
  the request's own blocks go to scratch blocks, which are only ever read by the same drafting
  loop (a later step rewrites those positions in the request's real blocks first).

Greedy requests draft the draft model's argmax; sampled requests draw from the draft model's
own distribution (same temperature / top-k / top-p / min-p), which is kept for the rejection
sampler (``draft_probs``) so that the target's distribution is preserved exactly.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from llmtower.core.outputs import SchedulerOutput
from llmtower.executor.input_batch import InputBatch
from llmtower.executor.kv_cache import KVCache
from llmtower.executor.rejection_sampler import target_probs
from llmtower.executor.sampler import _GREEDY_TEMPERATURE, draw_tokens
from llmtower.models.attention import (AttentionMetadata, PagedAttention, decode_batch,
                                       decode_groups)
from llmtower.models.interface import CausalLM
from llmtower.models.registry import model_class
from llmtower.spec_decode.config import SpeculativeConfig

# Requests drafted together in one pass of the draft loop: bounds the scratch blocks.
MAX_REQS_PER_PASS = 32


class DraftModelProposer:
    """Owns the draft model, its KV cache (the target's block ids + scratch blocks), its
    attention planner and the draft distributions of the drafts it proposed last."""

    needs_batch = True  # proposes from the runner's rows (block tables), not from histories

    def __init__(self, model: CausalLM, runner: Any, max_k: int) -> None:
        tkv = runner.kv_cache
        self.model = model
        self.block_size = bs = tkv.block_size
        self.num_blocks = tkv.num_blocks
        self.scratch_per_req = -(-max_k // bs) + 1
        num_scratch = MAX_REQS_PER_PASS * self.scratch_per_req
        cfg = model.config
        self.kv = KVCache(cfg, tkv.num_blocks + num_scratch, tkv.num_cpu_blocks, bs, model.dtype,
                          swap_layout=tkv.swap_layout)  # the same swap slots as the target's
        self.attn = PagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   bs, model.dtype, runner.attn.k_buf.shape[0],
                                   runner.attn.backend)
        self.decode_group_tokens = runner.decode_group_tokens
        self.sampler_generator = runner.sampler.generator
        self._probs: dict[str, torch.Tensor] = {}

    @classmethod
    def load(cls, config: SpeculativeConfig, runner: Any, dtype: torch.dtype = torch.float32
             ) -> DraftModelProposer:
        from llmtower.models.loader import load_model_config, load_state_dict, resolve_model_path

        path = resolve_model_path(config.model)
        mc = load_model_config(path)
        target = runner.model.config
        if mc.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model {config.model!r} has a vocabulary of "
                             f"{mc.vocab_size} tokens but the target has {target.vocab_size}: "
                             "a draft model must share the target's tokenizer")
        weights: dict = load_state_dict(path, dtype)
        model = model_class(mc.architecture)(mc, weights, dtype, runner.max_model_len)
        return cls(model, runner, config.num_speculative_tokens)

    # ------------------------------------------------------------------ keeping the cache in step
    def begin(self, so: SchedulerOutput) -> None:
        """The scheduler's block moves, on the draft cache too (the executor did the target's)."""
        self.kv.swap_out(so.blocks_to_swap_out, so.swap_out_compressed)
        self.kv.swap_in(so.blocks_to_swap_in, so.swap_in_compressed)
        self.kv.move(getattr(so, "blocks_to_move", []))

    def observe_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata) -> None:
        """Run the draft model over the target's flat batch: its KV at the same slots."""
        self.model(input_ids, positions, self.kv.kv_caches, self.attn, meta,
                   torch.empty(0, dtype=torch.int64))

    # ------------------------------------------------------------------ drafting
    def propose_from_batch(self, req_ids: list[str], rows: list[int], num_drafts: list[int],
                           batch: InputBatch) -> list[list[int]]:
        out: list[list[int]] = []
        for s in range(0, len(rows), MAX_REQS_PER_PASS):
            out.extend(self._propose_pass(req_ids[s:s + MAX_REQS_PER_PASS],
                                          rows[s:s + MAX_REQS_PER_PASS],
                                          num_drafts[s:s + MAX_REQS_PER_PASS], batch))
        return out

    @torch.inference_mode()
    def _propose_pass(self, req_ids: list[str], rows_l: list[int], ks: list[int],
                      batch: InputBatch) -> list[list[int]]:
        bs = self.block_size
        rows = np.asarray(rows_l, dtype=np.int64)
        last_pos = batch.num_tokens[rows] - 1
        order = np.argsort(last_pos, kind="stable")  # decode plans want ascending lengths
        rows, last_pos = rows[order], last_pos[order]
        m, k_max = len(rows), max(ks)
        held = batch.num_blocks[rows]
        width = int(held.max()) + self.scratch_per_req
        tables = np.zeros((m, width), dtype=np.int64)
        for i in range(m):
            h = int(held[i])
            tables[i, :h] = batch.block_table[rows[i], :h]
            first = self.num_blocks + i * self.scratch_per_req
            tables[i, h:h + self.scratch_per_req] = np.arange(first, first + self.scratch_per_req)
        tokens = batch.token_ids[rows, last_pos].astype(np.int64)
        greedy = batch.temperature[rows] < _GREEDY_TEMPERATURE
        drafts = np.zeros((m, k_max), dtype=np.int64)
        probs: list[list[torch.Tensor]] = [[] for _ in range(m)]
        idx = torch.arange(m)
        for j in range(k_max):
            pos = last_pos + j
            slots = tables[np.arange(m), pos // bs] * bs + pos % bs
            meta = AttentionMetadata(m, torch.from_numpy(slots))
            if self.attn.backend == "c":
                meta.decodes = decode_batch(tables, pos + 1, bs)
            else:
                meta.decode_groups = decode_groups(tables, pos + 1, bs, self.decode_group_tokens,
                                                   self.attn.dtype)
            logits = self.model(torch.from_numpy(tokens), torch.from_numpy(pos),
                                self.kv.kv_caches, self.attn, meta, idx)
            nxt = logits.argmax(dim=-1).numpy().copy()
            if not greedy.all():
                rnd = np.flatnonzero(~greedy)
                p = target_probs(logits[torch.from_numpy(rnd)], rows[rnd], batch)
                nxt[rnd] = draw_tokens(p, [batch.generators.get(int(rows[i])) for i in rnd],
                                       self.sampler_generator).numpy()
                for r, i in enumerate(rnd.tolist()):
                    probs[i].append(p[r])
            drafts[:, j] = nxt
            tokens = nxt
        k_sorted = np.asarray(ks, dtype=np.int64)[order]
        result: list[list[int]] = [[] for _ in range(m)]
        for i in range(m):
            k = int(k_sorted[i])
            result[int(order[i])] = drafts[i, :k].tolist()
            rid = req_ids[int(order[i])]
            if probs[i]:
                self._probs[rid] = torch.stack(probs[i][:k])
            else:
                self._probs.pop(rid, None)
        return result

    def draft_probs(self, req_id: str, n: int) -> torch.Tensor | None:
        """The draft distributions of ``req_id``'s last n drafts (None: drafted greedily)."""
        p = self._probs.get(req_id)
        return None if p is None else p[:n]

    # ------------------------------------------------------------------ the Proposer protocol
    def propose(self, req_ids, histories, num_drafts, num_prompts=None):  # noqa: ARG002
        raise TypeError("the draft-model proposer drafts from the runner's batch "
                        "(propose_from_batch)")

    def remove(self, req_id: str) -> None:
        self._probs.pop(req_id, None)
