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

Per call, a layer may ask for more than plain causal attention (``forward``'s keywords):
``sliding_window`` (a query at position p sees keys at positions > p - window, transformers'
semantics; only the blocks from the window's first on are read), ``logit_softcap`` (Gemma 2's
``cap * tanh(scores / cap)``), ``sinks`` (gpt-oss's per-head extra softmax column with no
value) and ``scale``. A C kernel that cannot do what is asked is skipped for that call and the
torch path (``attend``, an eager softmax where SDPA cannot express the option) serves it.
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
    ends: np.ndarray | None = None  # [c] context lengths (for window masks)
    # window -> ``mask`` with the keys before each request's window -inf too; built by the
    # first layer that asks, shared by the others
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The additive mask of a layer with this window (None: global)."""
        if window is None or self.ends is None or int(self.ends.max()) <= window:
            return self.mask
        m = self.window_masks.get(window)
        if m is None:
            length = self.mask.shape[-1]
            before = np.arange(length)[None, :] < (self.ends[:, None] - window)
            m = self.mask.masked_fill(torch.from_numpy(before).view(self.mask.shape), -np.inf)
            self.window_masks[window] = m
        return m


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
    _max_len: int = -1

    def __post_init__(self) -> None:
        if self.num_rows < 0:
            self.num_rows = self.num_reqs

    def max_len(self) -> int:
        """The longest context (once per step: windowed layers ask whether it matters)."""
        if self._max_len < 0:
            self._max_len = int(self.context_lens.max()) if self.num_reqs else 0
        return self._max_len


@dataclass
class PrefillSeq:
    """A chunk of more than one query token of one request."""

    token_start: int  # first row in the flat batch
    num_tokens: int
    num_computed: int  # context already in cache before this chunk
    block_ids: torch.Tensor | None = None  # only when num_computed > 0
    mask: torch.Tensor | None = None  # [num_tokens, num_computed + num_tokens], when num_computed > 0
    # window -> (first key read, the mask's columns from there with the keys before each
    # query's window masked too); built by the first layer that asks
    window_masks: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)

    def window_view(self, window: int | None, block_size: int) -> tuple[int, torch.Tensor]:
        """(first key position to read, a whole block's start; the bool mask from there) for
        a layer with this window (None: global)."""
        assert self.mask is not None
        if window is None or self.num_computed + self.num_tokens <= window:
            return 0, self.mask
        got = self.window_masks.get(window)
        if got is None:
            # The first query (position num_computed) sees keys > num_computed - window.
            first = max(0, self.num_computed - window + 1) // block_size * block_size
            pos = self.num_computed + np.arange(self.num_tokens)
            keys = np.arange(first, self.mask.shape[1])
            inside = torch.from_numpy(keys[None, :] > (pos[:, None] - window))
            got = self.window_masks[window] = (first, self.mask[:, first:] & inside)
        return got


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
            num_blocks=nb, mask=torch.from_numpy(mask).to(dtype).view(j - i, 1, 1, length),
            ends=end[i:j]))
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
                kv_cache: torch.Tensor, meta: AttentionMetadata, kv_written: bool = False, *,
                sliding_window: int | None = None, logit_softcap: float | None = None,
                sinks: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] for the step's new tokens -> output [T, H * D].
        ``kv_written``: the caller already stored k and v in their slots (the fused RoPE
        kernel does); k may then be None when no fresh prefill needs it. ``sliding_window``:
        this layer's window (None: global); ``logit_softcap``: scores -> cap * tanh(scores /
        cap); ``sinks`` [H]: per-head logits of an extra softmax column with no value;
        ``scale``: instead of head_dim ** -0.5."""
        hkv, d = self.num_kv_heads, self.head_dim
        if not kv_written:
            assert k is not None
            if kv_cache.dtype == self.dtype:
                kv_cache[0].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
                kv_cache[1].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
            else:  # --kv-cache-dtype: quantized (int8) or a narrower float (kv_quant.py)
                write_slots(kv_cache[0], meta.slot_mapping, k)
                write_slots(kv_cache[1], meta.slot_mapping, v)
        opts = _Options(self.scale if scale is None else scale, sliding_window, logit_softcap,
                        sinks)
        out = q.new_empty(meta.num_tokens, self.num_heads * d)
        if meta.decodes is not None:
            self._kernel_decodes(q, kv_cache, meta.decodes, out, opts)
        if meta.decode_groups:
            q = q.contiguous()  # SDPA is slower on the strided rows of the fused q/k output
        for g in meta.decode_groups:
            out[g.start:g.stop] = self._decode(q[g.start:g.stop], kv_cache, g, opts)
        for p in meta.prefills:
            rows = slice(p.token_start, p.token_start + p.num_tokens)
            if p.num_computed == 0:
                assert k is not None
                window = opts.window_within(p.num_tokens)
                # The C kernels: plain causal attention (a window of its own lengths is that).
                c_ok = opts.plain and window is None
                if c_ok and self.prefill_kernel:  # writes its rows of out in place
                    prefill_attention(q[rows], k[rows], v[rows],
                                      out[rows].view(p.num_tokens, self.num_heads, d),
                                      opts.scale, torch.get_num_threads())
                    continue
                if c_ok and self.prefill_f32:  # writes its rows of out in place
                    prefill_attention_f32(q[rows], k[rows], v[rows],
                                          out[rows].view(p.num_tokens, self.num_heads, d),
                                          opts.scale, torch.get_num_threads())
                    continue
                o = self._fresh_prefill(q[rows], k[rows], v[rows], opts)
            else:
                o = self._prefill_with_context(q[rows], kv_cache, p, opts)
            out[rows] = o
        return out

    def _kernel_decodes(self, q: torch.Tensor, kv_cache: torch.Tensor, db: DecodeBatch,
                        out: torch.Tensor, opts: _Options) -> None:
        """The C plan's decode rows: one kernel call, or (an option the kernels lack) the
        torch path request by request."""
        d, m = self.head_dim, db.num_rows
        if not db.checked:  # every layer's cache has the same blocks: once per step
            if db.query_start is not None:
                check_query_start("paged attention", db.query_start, db.context_lens, m)
            check_tables(db.block_tables, db.context_lens, kv_cache.shape[1], self.block_size)
            db.checked = True
        o = out[:m].view(m, self.num_heads, d)
        if not opts.plain or opts.window_within(db.max_len()) is not None:
            self._decode_rows(q[:m], kv_cache, db, o, opts)
        elif kv_cache.dtype != self.dtype:  # --kv-cache-dtype int8 / bfloat16 under float32
            paged_decode_kv(q[:m], kv_cache, db.block_tables, db.context_lens, o, opts.scale,
                            query_start=db.query_start)
        elif db.query_start is None:
            paged_decode(q[:m], kv_cache[0], kv_cache[1], db.block_tables, db.context_lens,
                         o, opts.scale, torch.get_num_threads(), tables_checked=True)
        else:  # some requests verify drafts: several causal rows each
            paged_decode_mq(q[:m], kv_cache[0], kv_cache[1], db.block_tables,
                            db.context_lens, db.query_start, o, opts.scale,
                            torch.get_num_threads(), checked=True)

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

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, g: DecodeGroup,
                opts: _Options) -> torch.Tensor:
        c = g.stop - g.start
        hkv, d, length = self.num_kv_heads, self.head_dim, g.num_blocks * self.block_size
        kb, vb = self._gather(kv_cache, g.block_ids)
        keys = kb.view(c, length, hkv, d).transpose(1, 2)  # [c, Hkv, L, D]
        values = vb.view(c, length, hkv, d).transpose(1, 2)
        # The query heads of one KV head become that head's query rows: [c, Hkv, G, D].
        qg = q.view(c, hkv, self.group, d)
        sinks = None if opts.sinks is None else opts.sinks.view(1, hkv, self.group, 1)
        o = attend(qg, keys, values, g.mask_for(opts.window), opts, sinks)
        return o.reshape(c, self.num_heads * d)

    def _decode_rows(self, q: torch.Tensor, kv_cache: torch.Tensor, db: DecodeBatch,
                     o: torch.Tensor, opts: _Options) -> None:
        """The C plan's rows on the torch path, request by request (options the kernels do
        not have): each request reads its blocks from its window's first on."""
        hkv, d, bs = self.num_kv_heads, self.head_dim, self.block_size
        lens = db.context_lens.tolist()
        starts = db.query_start.tolist() if db.query_start is not None else None
        sinks = None if opts.sinks is None else opts.sinks.view(1, self.num_heads, 1, 1)
        for r, ctx in enumerate(lens):
            a, b = (starts[r], starts[r + 1]) if starts is not None else (r, r + 1)
            pos = np.arange(ctx - (b - a), ctx)
            first = 0
            if opts.window is not None:
                first = max(0, int(pos[0]) - opts.window + 1) // bs * bs
            kb, vb = self._gather(kv_cache, db.block_tables[r, first // bs:-(-ctx // bs)])
            keys = kb.view(-1, hkv, d)[:ctx - first].transpose(0, 1).unsqueeze(0)
            values = vb.view(-1, hkv, d)[:ctx - first].transpose(0, 1).unsqueeze(0)
            mask = torch.from_numpy(_band(pos, first, ctx, opts.window))
            qr = q[a:b].transpose(0, 1).unsqueeze(0)
            o[a:b] = attend(qr, keys, values, mask, opts, sinks)[0].transpose(0, 1)

    def _fresh_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       opts: _Options) -> torch.Tensor:
        n = q.shape[0]
        window = opts.window_within(n)
        mask = None if window is None else torch.from_numpy(_band(np.arange(n), 0, n, window))
        sinks = None if opts.sinks is None else opts.sinks.view(1, self.num_heads, 1, 1)
        o = attend(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                   v.transpose(0, 1).unsqueeze(0), mask, opts, sinks, is_causal=mask is None)
        return o[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)

    def _prefill_with_context(self, q: torch.Tensor, kv_cache: torch.Tensor,
                              p: PrefillSeq, opts: _Options) -> torch.Tensor:
        assert p.block_ids is not None and p.mask is not None
        n = q.shape[0]
        hkv, d = self.num_kv_heads, self.head_dim
        first, mask = p.window_view(opts.window, self.block_size)
        keep = p.num_computed + p.num_tokens - first  # keys read, from ``first`` on
        kb, vb = self._gather(kv_cache, p.block_ids[first // self.block_size:])
        keys = kb.view(-1, hkv, d)[:keep].transpose(0, 1).unsqueeze(0)
        values = vb.view(-1, hkv, d)[:keep].transpose(0, 1).unsqueeze(0)
        sinks = None if opts.sinks is None else opts.sinks.view(1, self.num_heads, 1, 1)
        o = attend(q.transpose(0, 1).unsqueeze(0), keys, values, mask, opts, sinks)
        return o[0].transpose(0, 1).reshape(n, self.num_heads * d)


@dataclass
class _Options:
    """One layer call's attention options (``PagedAttention.forward``'s keywords)."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """No option SDPA (and the C kernels) lack, beyond a window."""
        return self.softcap is None and self.sinks is None

    def window_within(self, length: int) -> int | None:
        """The window where it hides keys of a context of ``length`` tokens, else None."""
        return self.window if self.window is not None and self.window < length else None


def _band(pos: np.ndarray, first: int, end: int, window: int | None) -> np.ndarray:
    """bool [len(pos), end - first]: query at position pos[i] sees key first + j (causal,
    and inside the window: key > pos - window)."""
    keys = np.arange(first, end)[None, :]
    seen = keys <= pos[:, None]
    if window is not None:
        seen &= keys > pos[:, None] - window
    return seen


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           mask: torch.Tensor | None, opts: _Options, sinks: torch.Tensor | None = None,
           is_causal: bool = False) -> torch.Tensor:
    """q [B, Hq, R, D] against keys / values [B, Hk, L, D] (query head h reads key head
    h // (Hq // Hk)); ``mask`` bool (True: seen) or additive, broadcast to [B, Hq, R, L];
    ``sinks`` broadcast to [B, Hq, R, 1]. SDPA where it can express the options, else an
    eager softmax (transformers' eager order: scale, soft-cap, mask, sinks, float32
    softmax)."""
    gqa = q.shape[1] != keys.shape[1]
    if opts.softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                              is_causal=is_causal, scale=opts.scale,
                                              enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(rep, dim=1)
        values = values.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, keys.transpose(-1, -2)) * opts.scale
    if opts.softcap is not None:
        s = torch.tanh(s / opts.softcap) * opts.softcap
    if is_causal:
        mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril(
            s.shape[-1] - s.shape[-2])
    if mask is not None:
        s = s.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else s + mask
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).expand(*s.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(s.float(), dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)
