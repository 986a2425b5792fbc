"""The model runner: one ``SchedulerOutput`` in, one forward pass and sampling, tokens out.

One step:
  1. apply the scheduler's deltas to the persistent ``InputBatch`` (finished requests leave,
     new ones get a row, cached ones get new blocks / a new progress count);
  2. build the flat batch with vectorized numpy: single-token queries first (sorted by context
     length), then longer chunks; each token's id, position and KV slot; which requests reach
     the end of their sequence (those are sampled);
  3. plan the attention once for all layers (``AttentionMetadata``): the single-token queries
     are cut into groups of similar context length, longer chunks are handled one by one;
  4. run the model over all T tokens, sample, append the sampled tokens to the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from llmtower.core.outputs import LogprobsEntry, ModelRunnerOutput, SchedulerOutput
from llmtower.executor.input_batch import InputBatch
from llmtower.executor.kv_cache import KVCache
from llmtower.executor.memory_bounds import HeapTrimmer, bound_native_caches
from llmtower.executor.prompt_logprobs import (PromptLogprobsPlan, compute_prompt_logprobs,
                                               plan_prompt_logprobs)
from llmtower.executor.sampler import Sampler
from llmtower.lora.model_manager import LoRAModelManager
from llmtower.lora.punica import LoRAStep
from llmtower.models.attention import (AttentionMetadata, PagedAttention, PrefillSeq,
                                       decode_batch, decode_groups, kernel_decode_mask)
from llmtower.models.interface import CausalLM
from llmtower.executor.spec_decode_step import SpecDecodeStep, expand_logits_indices
from llmtower.structured_output.bitmask import apply_grammar_bitmask, grammar_logits_rows

# Bytes of gathered K and V (one layer) per decode group: small enough to stay in the CPU's
# L3 cache between the gather and the attention that reads it, large enough to keep the number
# of calls per layer low. Measured on W1's decode phase with 2 threads (32 MiB L3): 12 MiB
# beats 2, 6, 9, 24 and 48 MiB.
DECODE_GROUP_BYTES = 12 * 2**20

# Steps where every request has one new token and no drafts take ``_prepare_decodes`` (the
# same inputs as ``_prepare_general``, fewer numpy calls: ~0.05 ms of a one-stream step, whose
# Python runs with cold caches after the weights streamed through). False: always the general
# path (tests and benchmarks compare the two).
DECODE_FAST_PATH = True

# Steps whose sampled rows are all plain greedy, few enough, take the model's greedy screen
# (kernels/greedy_head.py: the same tokens without reading the whole output layer). False:
# always full logits and the sampler (tests and benchmarks compare the two).
GREEDY_SCREEN = True


@dataclass
class StepInputs:
    """The flat batch of one step."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] rows of the flat batch whose next token is sampled
    sample_mask: np.ndarray  # [num requests] which scheduled requests are sampled
    sample_rows: np.ndarray  # [S] their InputBatch rows
    prompt_plan: PromptLogprobsPlan | None = None  # extra logits rows for prompt logprobs
    lora_ids: np.ndarray | None = None  # [T] each token's lora_int_id (None: no LoRA rows)


class ModelRunner:
    """Owns the model, the persistent ``InputBatch``, the attention planner and the sampler;
    the KV tensors it attends over belong to the ``KVCache`` it is given."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, max_model_len: int,
                 seed: int = 0, attention_backend: str = "auto") -> None:
        cfg = model.config
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = bs = kv_cache.block_size
        self.max_model_len = max_model_len
        self.batch = InputBatch(max_model_len, bs, cfg.vocab_size, cfg.eos_token_ids)
        elem = torch.empty((), dtype=model.dtype).element_size()
        bytes_per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * elem
        self.decode_group_tokens = max(bs, DECODE_GROUP_BYTES // bytes_per_token)
        buffer_blocks = max(self.decode_group_tokens // bs + 1, self.batch.max_blocks_per_req)
        self.attn = PagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads,
                                   cfg.head_dim, bs, model.dtype, buffer_blocks,
                                   attention_backend)
        self.sampler = Sampler(seed)
        # Native memory stays bounded over new per-step token counts (memory_bounds.py).
        bound_native_caches()
        self.heap_trimmer = HeapTrimmer()
        # Speculative decoding (--speculative-config), set by the executor; None: off.
        self.spec_decode: SpecDecodeStep | None = None
        # --enable-lora: the adapters, set by the executor; None: off.
        self.lora: LoRAModelManager | None = None

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        batch = self.batch
        for rid in so.finished_req_ids:
            if self.lora is not None and batch.num_lora_rows:
                self._release_lora(rid)
            batch.remove_request(rid)
        if so.blocks_to_move:  # before new requests join: their block ids are the moved ones
            batch.remap_block_ids(so.blocks_to_move)
        for new in so.scheduled_new_reqs:
            if new.lora_request is not None:
                if self.lora is None:
                    raise RuntimeError(f"request {new.req_id!r} names LoRA adapter "
                                       f"{new.lora_request.lora_name!r} but LoRA is not enabled")
                self.lora.hold(new.lora_request)  # loaded again if it was evicted
            batch.add_request(new)
        for c in so.scheduled_cached_reqs:
            batch.update_request(c)
        req_ids = list(so.num_scheduled_tokens)
        spec = self.spec_decode
        num_spec = spec.begin(so, req_ids, batch) if spec is not None else None
        if not req_ids:
            return ModelRunnerOutput([], [])
        inputs = self._prepare_inputs(so, req_ids, num_spec)
        plan = inputs.prompt_plan
        lora = self._lora_step(inputs)
        if self._greedy_only(so, inputs, spec):
            return self._execute_greedy(so, req_ids, inputs, lora)
        indices = inputs.logits_indices if plan is None else torch.cat(
            [inputs.logits_indices, plan.flat_rows])
        logits = self.model(inputs.input_ids, inputs.positions, self.kv_cache.kv_caches,
                            self.attn, inputs.meta, indices, **_lora_kw(lora))
        prompt_lps = None
        if plan is not None:  # the prompt rows come after the sampled ones
            num_sampled = len(inputs.logits_indices)
            prompt_lps = compute_prompt_logprobs(logits[num_sampled:], plan)
            logits = logits[:num_sampled]
        if so.grammar_bitmask is not None:  # structured outputs: what the grammars allow
            apply_grammar_bitmask(logits, so, req_ids, inputs.sample_mask)
        if spec is not None:  # verify drafts, append accepted tokens, propose the next
            assert num_spec is not None  # spec.begin ran above
            out = spec.sample(so, logits, req_ids, inputs, num_spec, batch, self.block_size)
        else:
            tokens, logprobs = self.sampler(logits, inputs.sample_rows, batch)
            batch.append_sampled(inputs.sample_rows, tokens)
            out = self._output(req_ids, inputs.sample_mask, tokens, logprobs)
        out.prompt_logprobs = prompt_lps
        self.heap_trimmer.after_step()
        return out

    def _greedy_only(self, so: SchedulerOutput, inputs: StepInputs,
                     spec: SpecDecodeStep | None) -> bool:
        """Whether this step needs only its sampled rows' argmax tokens (grammars allowing),
        few enough for the model's greedy screen: no drafts or prompt logprobs, every row
        plain greedy."""
        m = len(inputs.sample_rows)
        bitmask = so.grammar_bitmask
        return (GREEDY_SCREEN and spec is None and inputs.prompt_plan is None
                and (bitmask is None
                     or bitmask.shape[1] == -(-self.model.config.vocab_size // 32))
                and 0 < m <= self.model.greedy_rows()
                and self.sampler.plain_greedy(inputs.sample_rows, self.batch))

    def _release_lora(self, req_id: str) -> None:
        row = self.batch.req_id_to_row.get(req_id)
        if row is not None and self.lora is not None and self.batch.lora_ids[row] > 0:
            self.lora.release(int(self.batch.lora_ids[row]))

    def _lora_step(self, inputs: StepInputs) -> LoRAStep | None:
        """The step's adapter rows (None: none, the model's plain path)."""
        if self.lora is None or inputs.lora_ids is None:
            return None
        return self.lora.step(inputs.lora_ids)

    def _execute_greedy(self, so: SchedulerOutput, req_ids: list[str],
                        inputs: StepInputs, lora: LoRAStep | None = None) -> ModelRunnerOutput:
        """A step of plain greedy rows: the model stops at the final norm and picks the
        tokens (``CausalLM.greedy_tokens``: the argmax the sampler would take, after
        the grammars' bitmasks and the min_tokens masks)."""
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.kv_caches,
                            self.attn, inputs.meta, inputs.logits_indices, head=False,
                            **_lora_kw(lora))
        allow = None
        words = -(-self.model.config.vocab_size // 32)
        if so.grammar_bitmask is not None:
            logits_rows, mask_rows = grammar_logits_rows(so, req_ids, inputs.sample_mask)
            if logits_rows:  # the other rows allow every token
                allow = np.full((len(inputs.sample_rows), words), -1, np.int32)
                allow[logits_rows] = so.grammar_bitmask[mask_rows]
        allow = self.sampler.min_tokens_masks(inputs.sample_rows, self.batch, allow, words)
        tokens = self.model.greedy_tokens(hidden, allow)
        self.batch.append_sampled(inputs.sample_rows, tokens)
        out = self._output(req_ids, inputs.sample_mask, tokens, None)
        self.heap_trimmer.after_step()
        return out

    # ------------------------------------------------------------------ step inputs
    def _prepare_inputs(self, so: SchedulerOutput, req_ids: list[str],
                        num_spec: np.ndarray | None = None) -> StepInputs:
        batch = self.batch
        n = len(req_ids)
        r2r = batch.req_id_to_row
        rows = np.fromiter((r2r[r] for r in req_ids), dtype=np.int64, count=n)
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=n)
        if num_spec is None and DECODE_FAST_PATH and (num_sched == 1).all():
            return self._prepare_decodes(req_ids, rows, num_sched)
        return self._prepare_general(req_ids, rows, num_sched, num_spec)

    def _prepare_decodes(self, req_ids: list[str], rows: np.ndarray,
                         num_sched: np.ndarray) -> StepInputs:
        """``_prepare_general`` where every request has one new token (a plain decode step,
        no drafts): the same arrays with a third of the numpy calls. Each token is its
        request's whole query, so the flat batch is the requests sorted by context length and
        a token's flat row is its request's first (and last) row."""
        batch = self.batch
        n = len(req_ids)
        start = batch.num_computed_tokens[rows]
        end = start + 1
        num_tokens = batch.num_tokens[rows]
        self._check_not_past(end, num_tokens, req_ids)
        if n == 1:
            order = np.zeros(1, dtype=np.int64)
            o_rows, positions, o_end = rows, start, end
        else:
            order = np.argsort(end, kind="stable")
            o_rows, positions, o_end = rows[order], start[order], end[order]
        slots, input_ids = self._slots_and_ids(o_rows, positions)
        batch.num_computed_tokens[rows] = end
        sample_mask = end >= num_tokens
        flat_row = np.empty(n, dtype=np.int64)  # each request's flat row, in request order
        flat_row[order] = np.arange(n, dtype=np.int64)
        meta = AttentionMetadata(n, torch.from_numpy(slots))
        self._plan_decodes(meta, o_rows, o_end, num_sched)
        return StepInputs(torch.from_numpy(input_ids), torch.from_numpy(positions), meta,
                          torch.from_numpy(flat_row[sample_mask]), sample_mask,
                          rows[sample_mask],
                          plan_prompt_logprobs(batch, req_ids, rows, start, end, flat_row),
                          batch.lora_ids[o_rows] if batch.num_lora_rows else None)

    def _slots_and_ids(self, tok_rows: np.ndarray, positions: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
        """Each scheduled token's KV slot and token id, from its request's batch row and its
        position; a token past its request's block table is the scheduler and the runner
        disagreeing, never silently written elsewhere."""
        batch, bs = self.batch, self.block_size
        block_idx = positions // bs
        if (block_idx >= batch.num_blocks[tok_rows]).any():
            raise RuntimeError("a scheduled token has no KV block in its request's block table: "
                               "the scheduler's block ids and the runner's disagree")
        slots = batch.block_table[tok_rows, block_idx] * bs + positions % bs
        return slots, batch.token_ids[tok_rows, positions].astype(np.int64)

    @staticmethod
    def _check_not_past(end: np.ndarray, num_tokens: np.ndarray, req_ids: list[str]) -> None:
        if (end > num_tokens).any():
            bad = req_ids[int(np.flatnonzero(end > num_tokens)[0])]
            raise RuntimeError(f"request {bad!r} was scheduled past the tokens the runner holds: "
                               "the scheduler and the runner disagree on its sequence")

    def _prepare_general(self, req_ids: list[str], rows: np.ndarray, num_sched: np.ndarray,
                         num_spec: np.ndarray | None) -> StepInputs:
        batch = self.batch
        n = len(req_ids)
        start = batch.num_computed_tokens[rows]
        end = start + num_sched
        num_tokens = batch.num_tokens[rows]
        if num_spec is not None:
            num_tokens = num_tokens + num_spec  # draft tokens sit after the real ones
        self._check_not_past(end, num_tokens, req_ids)
        # Flat batch order: single-token queries first, sorted by context length so that each
        # decode group is a run of consecutive rows; then the longer chunks. With the C kernel
        # a decode with drafts (a few rows after a context) counts as a decode too.
        is_dec = kernel_decode_mask(num_sched, start, self.attn.backend, self.attn.dtype)
        dec = np.flatnonzero(is_dec)
        order = np.concatenate([dec[np.argsort(end[dec], kind="stable")], np.flatnonzero(~is_dec)])
        o_rows, o_sched, o_start, o_end = rows[order], num_sched[order], start[order], end[order]
        cu = np.cumsum(o_sched)
        first = cu - o_sched
        total = int(cu[-1])
        tok_rows = np.repeat(o_rows, o_sched)
        positions = np.arange(total, dtype=np.int64) + np.repeat(o_start - first, o_sched)
        slots, input_ids = self._slots_and_ids(tok_rows, positions)
        batch.num_computed_tokens[rows] = end
        # Sampled: requests whose computed tokens reach the end of their sequence, in the
        # scheduler's order, each from the flat row of its last token.
        sample_mask = end >= num_tokens
        last_row = np.empty(n, dtype=np.int64)
        last_row[order] = cu - 1
        meta = AttentionMetadata(total, torch.from_numpy(slots))
        k = len(dec)
        self._plan_decodes(meta, o_rows[:k], o_end[:k], o_sched[:k])
        self._plan_prefills(meta, o_rows[k:], o_sched[k:], first[k:], o_start[k:], o_end[k:])
        logits_rows = last_row[sample_mask]
        if num_spec is not None:  # a request with k drafts is verified at its last k + 1 rows
            logits_rows = expand_logits_indices(logits_rows, num_spec[sample_mask])
        flat_first = np.empty(n, dtype=np.int64)
        flat_first[order] = first
        return StepInputs(torch.from_numpy(input_ids), torch.from_numpy(positions), meta,
                          torch.from_numpy(logits_rows), sample_mask, rows[sample_mask],
                          plan_prompt_logprobs(batch, req_ids, rows, start, end, flat_first),
                          batch.lora_ids[tok_rows] if batch.num_lora_rows else None)

    def _plan_decodes(self, meta: AttentionMetadata, rows: np.ndarray, end: np.ndarray,
                      num_sched: np.ndarray) -> None:
        """The decode-like queries, first in the flat batch, ascending context length: one row
        per request, or (C backend) a few per request (``kernel_decode_mask``)."""
        if len(rows) == 0:
            return
        tables = self.batch.block_table[rows]
        if self.attn.backend == "c":
            meta.decodes = decode_batch(tables, end, self.block_size, num_sched)
        else:
            meta.decode_groups = decode_groups(tables, end, self.block_size,
                                               self.decode_group_tokens, self.attn.dtype)

    def _plan_prefills(self, meta: AttentionMetadata, rows: np.ndarray, num_sched: np.ndarray,
                       first: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
        bs = self.block_size
        for i in range(len(rows)):
            s, e, q = int(start[i]), int(end[i]), int(num_sched[i])
            p = PrefillSeq(int(first[i]), q, s)
            if s > 0:
                nb = -(-e // bs)
                p.block_ids = torch.from_numpy(self.batch.block_table[rows[i], :nb].copy())
                # Query i (position s + i) sees keys 0 .. s + i: causal, offset by the context.
                p.mask = torch.from_numpy(
                    np.arange(e)[None, :] <= (s + np.arange(q))[:, None])
            meta.prefills.append(p)

    # ------------------------------------------------------------------ output
    @staticmethod
    def _output(req_ids: list[str], sample_mask: np.ndarray, tokens: np.ndarray,
                logprobs: list[LogprobsEntry | None] | None) -> ModelRunnerOutput:
        sampled: list[list[int]] = [[] for _ in req_ids]
        tok_list = tokens.tolist()
        idx = np.flatnonzero(sample_mask).tolist()
        for j, i in enumerate(idx):
            sampled[i].append(tok_list[j])
        out_lp: list[list[LogprobsEntry]] | None = None
        if logprobs is not None:
            out_lp = [[] for _ in req_ids]
            for j, i in enumerate(idx):
                entry = logprobs[j]
                if entry is not None:
                    out_lp[i].append(entry)
        return ModelRunnerOutput(req_ids, sampled, out_lp)


def _lora_kw(lora: LoRAStep | None) -> dict[str, Any]:
    """The model's ``lora`` argument, passed only when the step has adapter rows (a step
    without them calls the model exactly as before LoRA existed)."""
    return {} if lora is None else {"lora": lora}
