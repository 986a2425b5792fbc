"""The model runner's persistent per-request state, kept in rows of preallocated arrays.

A request gets a row when the executor first sees it (``NewRequestData``) and keeps it until
it finishes, across preemptions; every later step only applies the deltas the scheduler sends
(new block ids, the new ``num_computed_tokens``, a replaced block table after preemption) and
the runner appends the tokens it samples. Per-step inputs (token ids, positions, KV slots) are
then read out of these arrays with vectorized numpy indexing, never rebuilt request by request.
"""
from __future__ import annotations

import numpy as np
import torch

from llmtower.core.outputs import CachedRequestData, NewRequestData
from llmtower.core.sampling_params import SamplingParams
from llmtower.utils import cdiv


class InputBatch:
    """Owns, per request row: token ids (prompt then outputs), progress counters, the block
    table, the sampling settings as arrays, and a seeded request's random generator."""

    def __init__(self, max_model_len: int, block_size: int, vocab_size: int,
                 eos_token_ids: list[int], initial_rows: int = 64) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_blocks_per_req = cdiv(max_model_len, block_size) + 1
        self.eos_token_ids = list(eos_token_ids)
        self.req_id_to_row: dict[str, int] = {}
        self.row_to_req_id: list[str | None] = []
        self.free_rows: list[int] = []
        self.capacity = 0
        # Row arrays, grown by doubling (see _grow).
        self.token_ids = np.zeros((0, max_model_len), dtype=np.int32)
        self.num_prompt_tokens = np.zeros(0, dtype=np.int64)
        self.num_tokens = np.zeros(0, dtype=np.int64)
        self.num_computed_tokens = np.zeros(0, dtype=np.int64)
        self.block_table = np.zeros((0, self.max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(0, dtype=np.int64)
        # Sampling settings per row.
        self.temperature = np.zeros(0, dtype=np.float32)
        self.top_k = np.zeros(0, dtype=np.int64)
        self.top_p = np.ones(0, dtype=np.float32)
        self.min_p = np.zeros(0, dtype=np.float32)
        self.presence_penalty = np.zeros(0, dtype=np.float32)
        self.frequency_penalty = np.zeros(0, dtype=np.float32)
        self.repetition_penalty = np.ones(0, dtype=np.float32)
        self.min_tokens = np.zeros(0, dtype=np.int64)
        self.num_logprobs = np.full(0, -1, dtype=np.int64)  # -1: no logprobs
        self.num_prompt_logprobs = np.full(0, -1, dtype=np.int64)  # -1: no prompt logprobs
        self.prompt_logprobs_next = np.zeros(0, dtype=np.int64)  # next prompt position to score
        # Anything beyond "argmax" or "softmax with temperature, then sample".
        self.needs_processing = np.zeros(0, dtype=bool)
        # Logprobs, a logit bias or a penalty: the logits matter beyond their argmax. A greedy
        # row without them takes the argmax of its logits after its min_tokens and grammar
        # masks (top-k, top-p and min-p never drop the top token).
        self.needs_full_logits = np.zeros(0, dtype=bool)
        self.stop_ids_for_min_tokens: dict[int, list[int]] = {}
        self.logit_bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # row -> (ids, bias)
        self.generators: dict[int, torch.Generator] = {}
        # Each row's LoRA adapter (lora_int_id, 0: none) and how many rows have one (0: steps
        # skip the per-token lookup).
        self.lora_ids = np.zeros(0, dtype=np.int64)
        self.num_lora_rows = 0
        self._grow(initial_rows)

    # ------------------------------------------------------------------ lifecycle
    def add_request(self, new: NewRequestData) -> int:
        if new.req_id in self.req_id_to_row:
            raise ValueError(f"request {new.req_id!r} is already in the model runner")
        n = len(new.prompt_token_ids)
        if n > self.max_model_len:
            raise ValueError(f"request {new.req_id!r} has {n} prompt tokens, more than "
                             f"max_model_len={self.max_model_len}")
        if not self.free_rows:
            self._grow(2 * self.capacity)
        row = self.free_rows.pop()
        self.req_id_to_row[new.req_id] = row
        self.row_to_req_id[row] = new.req_id
        self.token_ids[row, :n] = new.prompt_token_ids
        self.num_prompt_tokens[row] = n
        self.num_tokens[row] = n
        self.num_computed_tokens[row] = new.num_computed_tokens
        self._set_blocks(row, new.block_ids, replace=True)
        self._set_sampling(row, new.sampling_params, new.eos_token_id)
        lora_id = new.lora_request.lora_int_id if new.lora_request is not None else 0
        self.lora_ids[row] = lora_id
        self.num_lora_rows += lora_id > 0
        return row

    def update_request(self, c: CachedRequestData) -> int:
        row = self.req_id_to_row[c.req_id]
        if c.resumed_from_preemption:
            self._set_blocks(row, c.new_block_ids, replace=True)
            # The scheduler's view of the outputs is authoritative after a preemption.
            p = int(self.num_prompt_tokens[row])
            k = len(c.new_token_ids)
            if k:
                self.token_ids[row, p:p + k] = c.new_token_ids
            self.num_tokens[row] = p + k
        else:
            if c.new_block_ids:
                self._set_blocks(row, c.new_block_ids, replace=False)
            if c.new_token_ids:  # jump-forward tokens the scheduler appended
                n, k = int(self.num_tokens[row]), len(c.new_token_ids)
                self.token_ids[row, n:n + k] = c.new_token_ids
                self.num_tokens[row] = n + k
        self.num_computed_tokens[row] = c.num_computed_tokens
        return row

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        self.row_to_req_id[row] = None
        self.num_lora_rows -= self.lora_ids[row] > 0
        self.lora_ids[row] = 0
        self.generators.pop(row, None)
        self.stop_ids_for_min_tokens.pop(row, None)
        self.logit_bias.pop(row, None)
        self.free_rows.append(row)

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token to each of ``rows`` (vectorized)."""
        n = self.num_tokens[rows]
        ok = n < self.max_model_len  # the scheduler stops requests at max_model_len
        self.token_ids[rows[ok], n[ok]] = token_ids[ok]
        self.num_tokens[rows] = np.minimum(n + 1, self.max_model_len)

    def remap_block_ids(self, moves: list[tuple[int, int]]) -> None:
        """The relocator moved block ``src`` to ``dst``: rewrite every held block table."""
        if not moves or not self.req_id_to_row:
            return
        pairs = np.asarray(moves, dtype=np.int64)
        rows = np.fromiter(self.req_id_to_row.values(), dtype=np.int64)
        tables = self.block_table[rows]
        remap = np.arange(max(int(tables.max()), int(pairs.max())) + 1, dtype=np.int64)
        remap[pairs[:, 0]] = pairs[:, 1]
        self.block_table[rows] = remap[tables]

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    # ------------------------------------------------------------------ helpers
    def _set_blocks(self, row: int, block_ids: list[int], replace: bool) -> None:
        start = 0 if replace else int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(f"request {self.row_to_req_id[row]!r} would hold {end} KV blocks, "
                             f"more than max_model_len={self.max_model_len} needs")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def _set_sampling(self, row: int, sp: SamplingParams, eos_token_id: int | None) -> None:
        self.temperature[row] = sp.temperature
        self.top_k[row] = sp.top_k if 0 < sp.top_k < self.vocab_size else 0
        self.top_p[row] = sp.top_p
        self.min_p[row] = sp.min_p
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.repetition_penalty[row] = sp.repetition_penalty
        self.min_tokens[row] = sp.min_tokens
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        self.num_prompt_logprobs[row] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        self.prompt_logprobs_next[row] = 0
        if sp.min_tokens > 0:
            stop = list(sp.stop_token_ids)
            if not sp.ignore_eos:
                eos = self.eos_token_ids if eos_token_id is None else [eos_token_id]
                stop += [t for t in eos if t not in stop]
            ids = [t for t in stop if 0 <= t < self.vocab_size]
            if ids:  # none to mask (ignore_eos, no stop ids): min_tokens changes no logit
                self.stop_ids_for_min_tokens[row] = ids
        bias = {t: b for t, b in (sp.logit_bias or {}).items() if 0 <= t < self.vocab_size}
        if bias:
            self.logit_bias[row] = (torch.tensor(list(bias), dtype=torch.int64),
                                    torch.tensor(list(bias.values()), dtype=torch.float32))
        self.needs_processing[row] = (
            sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0.0 or sp.presence_penalty != 0.0
            or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0
            # min_tokens with nothing to mask (ignore_eos, no stop_token_ids) changes no logit:
            # such rows keep the sampler's fast path (one argmax for a greedy step)
            or bool(self.stop_ids_for_min_tokens.get(row))
            or sp.logprobs is not None or bool(bias))
        self.needs_full_logits[row] = (
            sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0
            or sp.repetition_penalty != 1.0 or sp.logprobs is not None or bool(bias))
        if sp.seed is not None and not sp.greedy:
            g = torch.Generator()
            g.manual_seed(sp.seed)
            self.generators[row] = g

    def _grow(self, capacity: int) -> None:
        capacity = max(capacity, 1)
        old = self.capacity
        if capacity <= old:
            return

        def grow(a: np.ndarray, fill=0) -> np.ndarray:
            out = np.full((capacity,) + a.shape[1:], fill, dtype=a.dtype)
            out[:old] = a
            return out

        self.token_ids = grow(self.token_ids)
        self.num_prompt_tokens = grow(self.num_prompt_tokens)
        self.num_tokens = grow(self.num_tokens)
        self.num_computed_tokens = grow(self.num_computed_tokens)
        self.block_table = grow(self.block_table)
        self.num_blocks = grow(self.num_blocks)
        self.temperature = grow(self.temperature)
        self.top_k = grow(self.top_k)
        self.top_p = grow(self.top_p, 1.0)
        self.min_p = grow(self.min_p)
        self.presence_penalty = grow(self.presence_penalty)
        self.frequency_penalty = grow(self.frequency_penalty)
        self.repetition_penalty = grow(self.repetition_penalty, 1.0)
        self.min_tokens = grow(self.min_tokens)
        self.num_logprobs = grow(self.num_logprobs, -1)
        self.num_prompt_logprobs = grow(self.num_prompt_logprobs, -1)
        self.prompt_logprobs_next = grow(self.prompt_logprobs_next)
        self.needs_processing = grow(self.needs_processing, False)
        self.needs_full_logits = grow(self.needs_full_logits, False)
        self.lora_ids = grow(self.lora_ids)
        self.row_to_req_id.extend([None] * (capacity - old))
        # New rows go under the free ones (pop() takes from the end), lowest row last.
        self.free_rows[:0] = range(capacity - 1, old - 1, -1)
        self.capacity = capacity
