"""The sampler: from one step's logits to one token per sampled request.

Order of operations (as in vLLM): logprobs are taken from the raw model distribution
(``log_softmax`` of the logits); then logit_bias is added and min_tokens masks EOS and stop
tokens; the repetition
penalty (Hugging Face's, over prompt and output) and the presence / frequency penalties
(OpenAI's, over the output) change the logits; greedy rows take the argmax of those; the other
rows are divided by their temperature, filtered by top-k, top-p and min-p, and sampled.

Sampling inverts each row's cumulative distribution at one uniform draw (``draw_tokens``). A
request with a seed has its own ``torch.Generator``, seeded once and advanced by exactly one
draw per token, so its tokens do not depend on what else is in the batch; the others share the
sampler's generator. (The exponential race ``argmax(p / E)`` draws from ``p`` too, but needs a
vocabulary of exponentials per token: 105 ms for a 64 x 49,152 step on 2 threads, against 2 ms
for a cumulative sum and a search; it was half of such a step's time.)
"""
from __future__ import annotations

import numpy as np
import torch

from llmtower.core.outputs import LogprobsEntry
from llmtower.executor.input_batch import InputBatch

# Temperatures below this are greedy: dividing by them would only overflow the logits.
_GREEDY_TEMPERATURE = 1e-5


class Sampler:
    """Owns the shared random generator; samples the rows of one step from their logits,
    reading each request's settings from the ``InputBatch``."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: np.ndarray, batch: InputBatch
                 ) -> tuple[np.ndarray, list[LogprobsEntry | None] | None]:
        """logits [S, vocab] float32 for batch ``rows`` -> (token ids [S], logprobs per row
        or None when no row asked for them)."""
        greedy = batch.temperature[rows] < _GREEDY_TEMPERATURE
        if greedy.all() and not batch.needs_processing[rows].any():
            return argmax_rows(logits), None  # the common fast path (plain_greedy)
        logprobs = self._logprobs_of_raw(logits, rows, batch)
        logits = self._process(logits, rows, batch)
        tokens = torch.from_numpy(argmax_rows(logits))
        if not greedy.all():
            random_idx = np.flatnonzero(~greedy)
            sel = torch.from_numpy(random_idx)
            tokens[sel] = self._sample(logits[sel], rows[random_idx], batch)
        tokens_np = tokens.numpy()
        entries = logprobs(tokens_np) if logprobs is not None else None
        return tokens_np, entries

    @staticmethod
    def plain_greedy(rows: np.ndarray, batch: InputBatch) -> bool:
        """Whether every one of these rows takes the argmax of its logits after its min_tokens
        (and grammar) masks: greedy, no logprobs, bias or penalty. Then the token is all the
        step needs (``min_tokens_masks`` gives the masks)."""
        return bool((batch.temperature[rows] < _GREEDY_TEMPERATURE).all()
                    and not batch.needs_full_logits[rows].any())

    @staticmethod
    def min_tokens_masks(rows: np.ndarray, batch: InputBatch, allow: np.ndarray | None,
                         words: int) -> np.ndarray | None:
        """``allow`` (int32 [rows, words] token bitmasks, or None: every token allowed) with
        the stop tokens cleared for the rows that have not reached their min_tokens yet, as
        ``_process`` sets their logits to -inf."""
        stops = batch.stop_ids_for_min_tokens
        if not stops:
            return allow
        for i, row in enumerate(rows.tolist()):
            ids = stops.get(row)
            if ids and batch.num_tokens[row] - batch.num_prompt_tokens[row] < batch.min_tokens[row]:
                if allow is None:
                    allow = np.full((len(rows), words), -1, dtype=np.int32)
                bits = allow.view(np.uint32)
                for t in ids:
                    bits[i, t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        return allow

    # ------------------------------------------------------------------ logits processing
    def _process(self, logits: torch.Tensor, rows: np.ndarray, batch: InputBatch) -> torch.Tensor:
        """logit_bias, min_tokens and the penalties, in place: the logits are this step's own
        (the raw logprobs were taken before), and a copy of a [64, 49152] float32 block costs
        more than the rest of the sampling of a greedy step."""
        needs = np.flatnonzero(batch.needs_processing[rows])
        if needs.size == 0:
            return logits
        # min_tokens sets its stop tokens to -inf, which no bias or penalty moves: one masked
        # write for all rows, after the per-row work.
        mask_rows: list[int] = []
        mask_ids: list[int] = []
        for i in needs.tolist():
            row = int(rows[i])
            stop_ids = batch.stop_ids_for_min_tokens.get(row)
            if stop_ids and (batch.num_tokens[row] - batch.num_prompt_tokens[row]
                             < batch.min_tokens[row]):
                mask_rows += [i] * len(stop_ids)
                mask_ids += stop_ids
            if (row in batch.logit_bias or batch.repetition_penalty[row] != 1.0
                    or batch.presence_penalty[row] != 0.0 or batch.frequency_penalty[row] != 0.0):
                self._process_row(logits[i], row, batch)
        if mask_rows:
            logits[torch.tensor(mask_rows), torch.tensor(mask_ids)] = float("-inf")
        return logits

    @staticmethod
    def _process_row(row_logits: torch.Tensor, row: int, batch: InputBatch) -> None:
        """logit_bias and the penalties of one request, in place (rare, so per row)."""
        num_prompt = int(batch.num_prompt_tokens[row])
        num_tokens = int(batch.num_tokens[row])
        bias = batch.logit_bias.get(row)
        if bias is not None:
            ids, values = bias
            row_logits[ids] += values.to(row_logits.dtype)
        rep = float(batch.repetition_penalty[row])
        if rep != 1.0:
            seen = torch.from_numpy(np.unique(batch.token_ids[row, :num_tokens]).astype(np.int64))
            vals = row_logits[seen]
            row_logits[seen] = torch.where(vals > 0, vals / rep, vals * rep)
        presence = float(batch.presence_penalty[row])
        frequency = float(batch.frequency_penalty[row])
        if (presence or frequency) and num_tokens > num_prompt:
            out = torch.from_numpy(batch.token_ids[row, num_prompt:num_tokens].astype(np.int64))
            counts = torch.bincount(out, minlength=row_logits.numel()).to(row_logits.dtype)
            row_logits -= frequency * counts + presence * (counts > 0).to(row_logits.dtype)

    def _sample(self, logits: torch.Tensor, rows: np.ndarray, batch: InputBatch) -> torch.Tensor:
        probs = filtered_probs(logits, rows, batch)
        return draw_tokens(probs, [batch.generators.get(int(r)) for r in rows], self.generator)

    # ------------------------------------------------------------------ logprobs
    @staticmethod
    def _logprobs_of_raw(logits: torch.Tensor, rows: np.ndarray, batch: InputBatch):
        k_per_row = batch.num_logprobs[rows]
        wanted = np.flatnonzero(k_per_row >= 0)
        if wanted.size == 0:
            return None
        lp = torch.log_softmax(logits[wanted], dim=-1)
        max_k = int(k_per_row[wanted].max())
        top_vals, top_ids = lp.topk(max_k, dim=-1) if max_k else (None, None)

        def entries(tokens: np.ndarray) -> list[LogprobsEntry | None]:
            out: list[LogprobsEntry | None] = [None] * len(rows)
            chosen = torch.from_numpy(tokens[wanted].astype(np.int64)).unsqueeze(1)
            chosen_lp = lp.gather(1, chosen)
            ranks = (lp > chosen_lp).sum(dim=-1) + 1
            chosen_lp_list = chosen_lp.squeeze(1).tolist()
            ranks_list = ranks.tolist()
            top_v = top_vals.tolist() if top_vals is not None else None
            top_i = top_ids.tolist() if top_ids is not None else None
            for j, i in enumerate(wanted):
                k = int(k_per_row[i])
                top = (list(zip(top_i[j][:k], top_v[j][:k]))
                       if k and top_i is not None and top_v is not None else [])
                out[i] = LogprobsEntry(int(tokens[i]), chosen_lp_list[j], ranks_list[j], top)
            return out

        return entries


def argmax_rows(logits: torch.Tensor) -> np.ndarray:
    """``logits.argmax(dim=-1)`` of a [S, vocab] float32 CPU tensor, as an int64 array, by
    numpy: the same index (the first maximum; the first NaN where a row has one), in about a
    sixth of the time (torch's CPU argmax reads ~2 GB/s here, numpy's SIMD one ~10 times
    that); the [64, 49152] logits of a batch-64 step cost 0.88 ms in torch, 0.14 ms here."""
    return np.argmax(logits.numpy(), axis=-1).astype(np.int64, copy=False)


def draw_tokens(probs: torch.Tensor, own: list[torch.Generator | None],
                shared: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` [S, vocab] (non-negative, not necessarily normalized):
    the first entry whose cumulative sum exceeds ``u`` times the row's total, ``u`` one uniform
    from the row's own generator (``own[i]``, a seeded request's) or, for rows without one, from
    ``shared``. A zero-probability entry is never drawn: its cumulative sum equals its
    predecessor's. float32 sums move each entry's chance by at most an ulp of the total (6e-8),
    far below what sampling can show."""
    u = torch.empty(len(own), 1)
    rest = [i for i, g in enumerate(own) if g is None]
    if rest:
        u[rest] = torch.rand(len(rest), 1, generator=shared)
    for i, g in enumerate(own):
        if g is not None:
            u[i].uniform_(generator=g)
    return pick_tokens(probs, u)


def pick_tokens(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` [S, vocab], the first entry whose cumulative sum exceeds ``u``
    [S, 1] (in [0, 1)) times the row's total; where that product rounds up to the total, the
    row's last entry with a non-zero chance."""
    cum = probs.cumsum(dim=-1)
    tokens = torch.searchsorted(cum, u * cum[:, -1:], right=True).squeeze(1)
    over = tokens >= probs.shape[-1]
    if over.any():
        tokens[over] = (cum[over] < cum[over][:, -1:]).sum(dim=-1)
    return tokens


def filtered_probs(logits: torch.Tensor, rows: np.ndarray, batch: InputBatch) -> torch.Tensor:
    """The distribution a sampled row draws from: its logits divided by its temperature,
    filtered by top-k and top-p, softmaxed, and cut by min-p. ``rows[i]`` is the InputBatch row
    whose settings apply to logits row i. After a min-p cut the rows are not renormalized (the
    exponential race does not need it); the rejection sampler renormalizes them itself."""
    temp = torch.from_numpy(batch.temperature[rows]).unsqueeze(1)
    logits = logits / temp
    top_k, top_p = batch.top_k[rows], batch.top_p[rows]
    if (top_k > 0).any() or (top_p < 1.0).any():
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    min_p = batch.min_p[rows]
    if (min_p > 0).any():
        threshold = probs.amax(dim=-1, keepdim=True) * torch.from_numpy(min_p).unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray) -> torch.Tensor:
    """Mask (to -inf) what top-k (0: off) and top-p (1.0: off) leave out, row by row settings."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if (top_k > 0).any():
        k = torch.from_numpy(np.where(top_k > 0, top_k, vocab)).unsqueeze(1)
        drop |= torch.arange(vocab).unsqueeze(0) >= k
    if (top_p < 1.0).any():
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # before it already does. The first token is always kept.
        before = probs.cumsum(dim=-1) - probs
        drop |= before >= torch.from_numpy(top_p).unsqueeze(1)
    drop[:, 0] = False
    mask = torch.zeros_like(drop).scatter_(1, sorted_idx, drop)
    return logits.masked_fill(mask, float("-inf"))
