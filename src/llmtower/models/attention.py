"""Paged attention on CPU: every request attends to its own KV blocks through its block table.

One layer's cache is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K at
index 0, V at 1); a token at position p of a request lives in slot ``block_table[p // block_size]
* block_size + p % block_size`` of the flattened ``[num_blocks * block_size, ...]`` view.

Per layer, ``PagedAttention.forward`` first writes the K/V of *all* new tokens of the step into
their slots, and only then lets requests attend, so a request may read blocks that another
request of the same step fills. Then three kinds of work, planned once per step in
``AttentionMetadata`` and reused by every layer:

- decodes: requests with one query token (decodes, and 1-token chunks), which the runner puts
  first in the flat batch, sorted by context length. Two backends:
  * ``c`` (float32 or bfloat16, where a C compiler exists; the default there): one call of
    the C kernel ``kernels/paged_attention.c`` serves them all, reading each request's keys
    and values in place through its block table, each exactly once. With this backend a
    request with a context and a few new tokens (``MAX_DECODE_QUERY_ROWS``: a decode with its
    speculative drafts, a short chunk after a prefix-cache hit) is a decode too: the
    multi-query kernel (``paged_decode_mq``) gives each of its rows the context plus the rows
    before it, in the same one call per layer;
  * ``torch``: the decodes are cut into groups; a group's blocks are gathered (whole blocks,
    ``index_select`` into a reused buffer small enough to stay in the CPU cache) and one
    ``scaled_dot_product_attention`` call with a length mask serves the group. Under GQA the
    query heads sharing a KV head are laid out as that head's "query rows", so keys are never
    repeated. On W1 this is 2x (float32) to 6x (bfloat16) slower than the kernel: the gather
    is a copy of every block.
- fresh prefills: chunks starting at position 0 attend only to themselves: causal attention on
  the new K/V, no gather: in bfloat16 the C kernel ``kernels/prefill_attention.c`` (AVX-512
  BF16 dot products, C backend), in float32 ``kernels/prefill_attention_f32.c`` (AVX-512, C
  backend), else SDPA.
- prefills with context (later chunks of a chunked prefill, prefix-cache hits, recompute): the
  request's blocks are gathered and SDPA runs with a causal mask offset by the context length.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from llmtower.kernels.kv_quant import read_rows, write_slots
from llmtower.kernels import ops
from llmtower.kernels.paged_attention import (check_query_start, check_tables, paged_decode,
                                              paged_decode_mq)
from llmtower.kernels.paged_attention_int8 import paged_decode_kv
from llmtower.kernels.prefill_attention import prefill_attention, prefill_shape_ok
from llmtower.kernels.prefill_attention_f32 import prefill_attention_f32, prefill_f32_shape_ok

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "c", "torch")
# Longest run of new tokens of one request (after a cached context) that the C decode kernel
# takes, by dtype. Longer runs go to SDPA, whose matrix products beat the kernel's dot products
# once many rows share each key: measured with benchmarks/paged_attention_kernel.py
# --multi-query (8 requests, SmolLM2's shape, 1 thread), the kernel is 2.2x faster at 2 rows,
# 1.4x at 5 and even at 9 in float32; in bfloat16 even at about 6 (it widens every key again
# for each four queries).
MAX_DECODE_QUERY_ROWS = {torch.float32: 9, torch.bfloat16: 6}


def resolve_backend(backend: str, dtype: torch.dtype) -> str:
    """``auto`` -> ``c`` where the kernel builds (float32 and bfloat16), else ``torch``."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if backend == "torch":
        return backend
    if dtype not in (torch.float32, torch.bfloat16):
        if backend == "c":
            raise ValueError(f"attention_backend='c' runs float32 and bfloat16, not {dtype}: "
                             "use --attention-backend torch (or auto) for this dtype")
        return "torch"
    err = ops.capabilities().why_not("paged_attention")
    if err is None:
        return "c"
    if backend == "c":
        raise RuntimeError(f"attention_backend='c' but the C kernel is unavailable: {err}")
    logger.warning("C attention kernel unavailable, using the PyTorch path (2-6x slower "
                   "decode attention): %s", err)
    return "torch"


@dataclass
class DecodeGroup:
    """Requests with one query token each, attended together; their queries are the
    consecutive rows ``start:stop`` of the flat batch."""

    start: int
    stop: int
    block_ids: torch.Tensor  # [c * num_blocks] block tables, padded per request to num_blocks
    num_blocks: int
    # [c, 1, 1, num_blocks * block_size], additive: 0 where the key exists, -inf past the end
    mask: torch.Tensor


@dataclass
class DecodeBatch:
    """All decode-like queries of the step, for the C kernel: flat rows ``0:num_rows``, one
    per request, or (``query_start``) each request's consecutive new tokens."""

    num_reqs: int
    block_tables: torch.Tensor  # [num_reqs, max blocks] int64; past a request's own blocks: unread
    context_lens: torch.Tensor  # [num_reqs] int64: keys the request's last query attends to
    checked: bool = False  # tables and lengths checked against the cache (once per step)
    # [num_reqs + 1] int64: request r owns rows query_start[r]:query_start[r + 1]; None when
    # every request has one row (the one-query kernel)
    query_start: torch.Tensor | None = None
    num_rows: int = -1  # flat rows in all; -1: num_reqs

    def __post_init__(self) -> None:
        if self.num_rows < 0:
            self.num_rows = self.num_reqs


@dataclass
class PrefillSeq:
    """A chunk of more than one query token of one request."""

    token_start: int  # first row in the flat batch
    num_tokens: int
    num_computed: int  # context already in cache before this chunk
    block_ids: torch.Tensor | None = None  # only when num_computed > 0
    mask: torch.Tensor | None = None  # [num_tokens, num_computed + num_tokens], when num_computed > 0


@dataclass
class AttentionMetadata:
    """How the step's flat batch of new tokens maps onto requests and KV slots; built once per
    step by the model runner and shared by all layers."""

    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot of each new token
    decodes: DecodeBatch | None = None  # backend "c"
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSeq] = field(default_factory=list)


def decode_batch(tables: np.ndarray, end: np.ndarray, block_size: int,
                 q_lens: np.ndarray | None = None) -> DecodeBatch:
    """The C kernel's plan for decodes with block tables ``tables`` [m, >= blocks], context
    lengths ``end`` [m] and, optionally, ``q_lens`` [m] new tokens each (default one)."""
    nb = -(-int(end.max()) // block_size)
    db = DecodeBatch(len(end), torch.from_numpy(np.ascontiguousarray(tables[:, :nb])),
                     torch.from_numpy(np.ascontiguousarray(end, dtype=np.int64)))
    if q_lens is not None and (q_lens != 1).any():
        starts = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=starts[1:])
        db.query_start = torch.from_numpy(starts)
        db.num_rows = int(starts[-1])
    return db


def kernel_decode_mask(num_sched: np.ndarray, start: np.ndarray, backend: str,
                       dtype: torch.dtype) -> np.ndarray:
    """Which scheduled requests the decode plan takes: one new token each, and with the C
    backend also a run of up to ``MAX_DECODE_QUERY_ROWS`` after a cached context (drafts)."""
    one = num_sched == 1
    if backend != "c":
        return one
    return one | ((start > 0) & (num_sched <= MAX_DECODE_QUERY_ROWS.get(dtype, 1)))


def decode_groups(tables: np.ndarray, end: np.ndarray, block_size: int, budget_tokens: int,
                  dtype: torch.dtype) -> list[DecodeGroup]:
    """The torch backend's plan: consecutive decodes (ascending ``end``) cut into groups whose
    padded K/V stays within ``budget_tokens`` tokens."""
    m = len(end)
    padded = -(-end // block_size) * block_size  # context rounded up to whole blocks
    groups = []
    i = 0
    while i < m:
        j = i + 1
        # Ascending: a group's padded length is that of its last member.
        while j < m and (j + 1 - i) * padded[j] <= budget_tokens:
            j += 1
        nb = int(padded[j - 1]) // block_size
        length = nb * block_size
        # Additive float mask: SDPA would convert a boolean one on every call of every layer.
        mask = np.where(np.arange(length)[None, :] < end[i:j, None], 0.0, -np.inf)
        groups.append(DecodeGroup(
            start=i, stop=j, block_ids=torch.from_numpy(tables[i:j, :nb].reshape(-1)),
            num_blocks=nb, mask=torch.from_numpy(mask).to(dtype).view(j - i, 1, 1, length)))
        i = j
    return groups


class PagedAttention:
    """Owns the attention shapes, the decode backend and a reusable gather buffer; computes one
    layer's attention for the whole flat batch against that layer's paged cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, gather_buffer_blocks: int, backend: str = "auto") -> None:
        self.backend = resolve_backend(backend, dtype)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.group = num_heads // num_kv_heads
        self.dtype = dtype
        self.scale = head_dim ** -0.5
        # Fresh prefills in bfloat16: the C kernel (prefill_attention.c, AVX-512 BF16) where it
        # runs, 3-6x faster than SDPA on SmolLM2's chunks; elsewhere, and with the torch
        # backend, SDPA.
        caps = ops.capabilities()
        self.prefill_kernel = (dtype == torch.bfloat16 and self.backend == "c"
                               and prefill_shape_ok(num_heads, num_kv_heads, head_dim)
                               and caps.can_run("prefill_bf16"))
        # float32: its sibling (prefill_attention_f32.c, AVX-512, float32 throughout; 2.3-4.4x
        # SDPA on SmolLM2's chunks), C backend only.
        self.prefill_f32 = (dtype == torch.float32 and self.backend == "c"
                            and prefill_f32_shape_ok(num_heads, num_kv_heads, head_dim)
                            and caps.can_run("prefill_f32"))
        shape = (gather_buffer_blocks, block_size, num_kv_heads, head_dim)
        # Reused across layers and steps: fresh large allocations would page-fault every time.
        self.k_buf = torch.zeros(shape, dtype=dtype)
        self.v_buf = torch.zeros(shape, dtype=dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                kv_written: bool = False) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] for the step's new tokens -> output [T, H * D].
        ``kv_written``: the caller already stored k and v in their slots (the fused RoPE
        kernel does); k may then be None when no fresh prefill needs it."""
        hkv, d = self.num_kv_heads, self.head_dim
        if not kv_written:
            assert k is not None
            if kv_cache.dtype == self.dtype:
                kv_cache[0].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
                kv_cache[1].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
            else:  # --kv-cache-dtype: quantized (int8) or a narrower float (kv_quant.py)
                write_slots(kv_cache[0], meta.slot_mapping, k)
                write_slots(kv_cache[1], meta.slot_mapping, v)

        out = q.new_empty(meta.num_tokens, self.num_heads * d)
        if meta.decodes is not None:
            db, m = meta.decodes, meta.decodes.num_rows
            if not db.checked:  # every layer's cache has the same blocks: once per step
                if db.query_start is not None:
                    check_query_start("paged attention", db.query_start, db.context_lens, m)
                check_tables(db.block_tables, db.context_lens, kv_cache.shape[1], self.block_size)
                db.checked = True
            o = out[:m].view(m, self.num_heads, d)
            if kv_cache.dtype != self.dtype:  # --kv-cache-dtype int8 / bfloat16 under float32
                paged_decode_kv(q[:m], kv_cache, db.block_tables, db.context_lens, o, self.scale,
                                query_start=db.query_start)
            elif db.query_start is None:
                paged_decode(q[:m], kv_cache[0], kv_cache[1], db.block_tables, db.context_lens,
                             o, self.scale, torch.get_num_threads(), tables_checked=True)
            else:  # some requests verify drafts: several causal rows each
                paged_decode_mq(q[:m], kv_cache[0], kv_cache[1], db.block_tables,
                                db.context_lens, db.query_start, o, self.scale,
                                torch.get_num_threads(), checked=True)
        if meta.decode_groups:
            q = q.contiguous()  # SDPA is slower on the strided rows of the fused q/k output
        for g in meta.decode_groups:
            out[g.start:g.stop] = self._decode(q[g.start:g.stop], kv_cache, g)
        for p in meta.prefills:
            rows = slice(p.token_start, p.token_start + p.num_tokens)
            if p.num_computed == 0:
                assert k is not None
                if self.prefill_kernel:  # writes its rows of out in place
                    prefill_attention(q[rows], k[rows], v[rows],
                                      out[rows].view(p.num_tokens, self.num_heads, d),
                                      self.scale, torch.get_num_threads())
                    continue
                if self.prefill_f32:  # writes its rows of out in place
                    prefill_attention_f32(q[rows], k[rows], v[rows],
                                          out[rows].view(p.num_tokens, self.num_heads, d),
                                          self.scale, torch.get_num_threads())
                    continue
                o = self._fresh_prefill(q[rows], k[rows], v[rows])
            else:
                o = self._prefill_with_context(q[rows], kv_cache, p)
            out[rows] = o
        return out

    # ------------------------------------------------------------------ the three kinds
    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        n = block_ids.numel()
        if kv_cache.dtype != self.dtype:  # --kv-cache-dtype: gather the stored rows, widen
            d = self.head_dim
            return (read_rows(torch.index_select(kv_cache[0], 0, block_ids), self.dtype, d),
                    read_rows(torch.index_select(kv_cache[1], 0, block_ids), self.dtype, d))
        if n <= self.k_buf.shape[0]:
            kb = torch.index_select(kv_cache[0], 0, block_ids, out=self.k_buf[:n])
            vb = torch.index_select(kv_cache[1], 0, block_ids, out=self.v_buf[:n])
        else:  # a long context that outgrows the buffer: rare, allocate
            kb = torch.index_select(kv_cache[0], 0, block_ids)
            vb = torch.index_select(kv_cache[1], 0, block_ids)
        return kb, vb

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, g: DecodeGroup) -> torch.Tensor:
        c = g.stop - g.start
        hkv, d, length = self.num_kv_heads, self.head_dim, g.num_blocks * self.block_size
        kb, vb = self._gather(kv_cache, g.block_ids)
        keys = kb.view(c, length, hkv, d).transpose(1, 2)  # [c, Hkv, L, D]
        values = vb.view(c, length, hkv, d).transpose(1, 2)
        # The query heads of one KV head become that head's query rows: [c, Hkv, G, D].
        qg = q.view(c, hkv, self.group, d)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=g.mask, scale=self.scale)
        return o.reshape(c, self.num_heads * d)

    def _fresh_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=self.scale,
            enable_gqa=self.group > 1)
        return o[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)

    def _prefill_with_context(self, q: torch.Tensor, kv_cache: torch.Tensor,
                              p: PrefillSeq) -> torch.Tensor:
        assert p.block_ids is not None and p.mask is not None
        n = q.shape[0]
        hkv, d = self.num_kv_heads, self.head_dim
        ctx = p.num_computed + p.num_tokens
        kb, vb = self._gather(kv_cache, p.block_ids)
        keys = kb.view(-1, hkv, d)[:ctx].transpose(0, 1).unsqueeze(0)
        values = vb.view(-1, hkv, d)[:ctx].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=p.mask, scale=self.scale,
            enable_gqa=self.group > 1)
        return o[0].transpose(0, 1).reshape(n, self.num_heads * d)
