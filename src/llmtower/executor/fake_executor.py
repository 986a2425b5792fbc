"""A model-free executor for scheduler tests, benchmarks and the simulator's token stream.

Its "model" picks the next token as a deterministic function of the whole sequence so far.
With ``verify_kv`` it keeps a fake KV cache, an array of token ids per block slot, written
and read through each request's block table exactly as a real runner would, and the next
token is computed from what it *reads back*: a wrong block table, a lost swap or a bad
prefix-cache hit changes the output, so tests comparing with an unlimited-memory run catch it.
With ``window`` (a model whose every layer has that sliding window) it reads back only the
window's positions, the earlier ones coming from its own record: the scheduler may have given
those blocks away.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from collections.abc import Callable

import numpy as np

from llmtower.core.outputs import ModelRunnerOutput, SchedulerOutput


def _allowed_token(bitmask_row: np.ndarray, tok: int, vocab_size: int) -> int:
    """``tok`` if the grammar bitmask allows it, else the next allowed id (wrapping)."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    allowed = np.flatnonzero(bits)
    if allowed.size == 0:
        return tok
    i = int(np.searchsorted(allowed, tok))
    return int(allowed[i % allowed.size])


def fake_next_token(token_ids, vocab_size: int) -> int:
    """The fake model: a deterministic function of the whole sequence."""
    return zlib.crc32(np.asarray(token_ids, dtype=np.int64).tobytes()) % vocab_size


@dataclass
class _ReqState:
    token_ids: list[int]
    num_prompt: int
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


class FakeExecutor:
    """Owns a fake KV cache (token ids per slot) and the per-request runner state, which it
    keeps across steps and updates only from the deltas of each ``SchedulerOutput``."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 vocab_size: int = 64, verify_kv: bool = True,
                 token_fn: Callable[[str, list[int]], int] | None = None,
                 window: int | None = None) -> None:
        self.block_size = block_size
        self.window = window
        self.vocab_size = vocab_size
        self.verify_kv = verify_kv
        # token_fn(request_id, sequence) -> next token; default: the fake model above.
        self.token_fn = token_fn or (lambda _rid, seq: fake_next_token(seq, vocab_size))
        self.kv = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.cpu_kv = np.full((max(num_cpu_blocks, 1), block_size), -1, dtype=np.int64)
        self.reqs: dict[str, _ReqState] = {}
        self.num_steps = 0

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        # Swaps and moves happen before the forward pass, in this order.
        for src, dst in so.blocks_to_swap_out:
            self.cpu_kv[dst] = self.kv[src]
        for src, dst in so.blocks_to_swap_in:
            self.kv[dst] = self.cpu_kv[src]
        self.apply_block_moves(so.blocks_to_move)
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id] = _ReqState(list(new.prompt_token_ids),
                                              len(new.prompt_token_ids), list(new.block_ids),
                                              new.num_computed_tokens)
        for c in so.scheduled_cached_reqs:
            st = self.reqs[c.req_id]
            if c.resumed_from_preemption:
                st.block_ids = list(c.new_block_ids)
                st.token_ids = st.token_ids[:st.num_prompt] + list(c.new_token_ids)
            else:
                st.block_ids.extend(c.new_block_ids)
                st.token_ids.extend(c.new_token_ids)  # jump-forward tokens, if any
            st.num_computed = c.num_computed_tokens
        bs = self.block_size
        req_ids = list(so.num_scheduled_tokens)
        # Write every scheduled token's "KV" first, then read: like a real attention layer,
        # which stores the whole batch's new keys before any request attends.
        if self.verify_kv:
            for rid in req_ids:
                st = self.reqs[rid]
                for p in range(st.num_computed, st.num_computed + so.num_scheduled_tokens[rid]):
                    self.kv[st.block_ids[p // bs], p % bs] = st.token_ids[p]
        sampled: list[list[int]] = []
        for rid in req_ids:
            st = self.reqs[rid]
            end = st.num_computed + so.num_scheduled_tokens[rid]
            st.num_computed = end
            if end < len(st.token_ids):
                sampled.append([])  # a prefill chunk short of the prompt's end
                continue
            if self.verify_kv:
                first = 0 if self.window is None else max(0, end - self.window)
                seq = st.token_ids[:first] + [int(self.kv[st.block_ids[p // bs], p % bs])
                                              for p in range(first, end)]
            else:
                seq = st.token_ids[-4:] + [end]
            tok = self.token_fn(rid, seq)
            row = so.structured_output_request_ids.get(rid)
            if row is not None:  # structured outputs: the nearest token the grammar allows
                assert so.grammar_bitmask is not None  # set whenever a row is
                tok = _allowed_token(so.grammar_bitmask[row], tok, self.vocab_size)
            st.token_ids.append(tok)
            sampled.append([tok])
        return ModelRunnerOutput(req_ids, sampled)

    def apply_block_moves(self, moves: list[tuple[int, int]]) -> None:
        """The relocator's moves: gather every source, then scatter (a batch may rotate a
        cycle), and rewrite the block tables the runner holds."""
        if not moves:
            return
        src = np.array([s for s, _ in moves])
        dst = np.array([d for _, d in moves])
        self.kv[dst] = self.kv[src].copy()
        remap = dict(moves)
        for st in self.reqs.values():
            st.block_ids = [remap.get(b, b) for b in st.block_ids]

    def shutdown(self) -> None:
        pass
