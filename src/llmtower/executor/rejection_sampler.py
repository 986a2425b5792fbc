"""The rejection sampler: verify each request's draft tokens against the target model's
distribution at every draft position, in one pass over the logits of one forward pass.

Request r with drafts x_1..x_k comes with k + 1 rows of logits: row j (0-based) is the target
model's distribution p_j for the token after x_1..x_j (row 0: after the request's last token).

- Greedy requests keep the longest prefix of drafts with x_{j+1} == argmax p_j, then add the
  argmax at the first mismatch (or after the last draft: the bonus token). The output is
  token-identical to decoding without speculation.
- Sampled requests use rejection sampling (Leviathan et al. 2023, Chen et al. 2023): x_{j+1}
  is accepted with probability min(1, p_j(x) / q_j(x)), where q_j is the draft distribution
  (a point mass for n-gram and suffix drafts, so the chance is p_j(x)); at the first rejection
  a token is drawn from normalize(max(0, p_j - q_j)) and the request stops there; if all k are
  accepted a bonus token is drawn from p_k. Every emitted token is then distributed exactly as
  if the target model had sampled it alone.

p_j is the distribution the plain sampler draws from: logits / temperature, top-k, top-p,
min-p. Requests that need penalties, min_tokens or logprobs are never given drafts (their
processing depends on every earlier token), so they never reach this sampler.

A request with a seed draws its uniforms and its final token from its own generator, k
uniforms then one vocabulary-sized exponential race, so a seeded request's tokens depend only
on its seed and its drafts, never on the rest of the batch.
"""
from __future__ import annotations

import numpy as np
import torch

from llmtower.executor.input_batch import InputBatch
from llmtower.executor.sampler import _GREEDY_TEMPERATURE, draw_tokens, filtered_probs


class RejectionSampler:
    """Owns nothing but the fallback generator (the sampler's shared one, for unseeded
    requests); turns one step's target logits and drafts into accepted tokens per request."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, offsets: np.ndarray, drafts: list[list[int]],
                 rows: np.ndarray, batch: InputBatch,
                 draft_probs: list[torch.Tensor | None] | None = None) -> list[list[int]]:
        """``logits`` [N, vocab]; request i's k_i + 1 rows start at ``offsets[i]``;
        ``drafts[i]`` its k_i >= 1 draft tokens; ``rows[i]`` its InputBatch row;
        ``draft_probs[i]`` [k_i, vocab] its draft distributions (None: point masses).
        Returns, per request, the accepted drafts plus one final token."""
        greedy = batch.temperature[rows] < _GREEDY_TEMPERATURE
        out: list[list[int]] = [[] for _ in drafts]
        if greedy.any():
            argmax = logits.argmax(dim=-1).tolist()
            for i in np.flatnonzero(greedy).tolist():
                out[i] = _greedy_accept(drafts[i], argmax, int(offsets[i]))
        random_idx = np.flatnonzero(~greedy)
        if random_idx.size:
            sel = np.concatenate([np.arange(offsets[i], offsets[i] + len(drafts[i]) + 1)
                                  for i in random_idx.tolist()])
            row_of_sel = np.repeat(rows[random_idx], [len(drafts[i]) + 1 for i in random_idx])
            probs = target_probs(logits[torch.from_numpy(sel)], row_of_sel, batch)
            start = 0
            for i in random_idx.tolist():
                k = len(drafts[i])
                q = draft_probs[i] if draft_probs is not None else None
                gen = batch.generators.get(int(rows[i]), self.generator)
                out[i] = _sample_accept(drafts[i], probs[start:start + k + 1], q, gen)
                start += k + 1
        return out


def _greedy_accept(draft: list[int], argmax: list[int], offset: int) -> list[int]:
    out = []
    for j, x in enumerate(draft):
        t = argmax[offset + j]
        out.append(t)
        if t != x:
            return out
    out.append(argmax[offset + len(draft)])  # all accepted: the bonus token
    return out


def _sample_accept(draft: list[int], p: torch.Tensor, q: torch.Tensor | None,
                   gen: torch.Generator) -> list[int]:
    """p [k+1, vocab] target probabilities, q [k, vocab] draft probabilities or None."""
    k = len(draft)
    idx = torch.tensor(draft, dtype=torch.int64)
    p_x = p[:k].gather(1, idx.unsqueeze(1)).squeeze(1)
    if q is None:
        ratio = p_x  # q_j(x) = 1
    else:
        q_x = q.gather(1, idx.unsqueeze(1)).squeeze(1)
        ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(1e-30), torch.ones_like(p_x))
    u = torch.rand(k, generator=gen, dtype=p.dtype)
    rejected = (u >= ratio).nonzero().flatten()  # accept iff u < min(1, ratio)
    a = int(rejected[0]) if rejected.numel() else k
    out = draft[:a]
    if a == k:
        dist = p[k]
    else:
        dist = p[a].clone()
        if q is None:
            dist[draft[a]] = 0.0
        else:
            dist = (dist - q[a]).clamp_min_(0.0)
        if float(dist.sum()) <= 0.0:  # p == q: a rejection had probability 0; be safe
            dist = p[a]
    out.append(int(draw_tokens(dist.unsqueeze(0), [gen], gen)[0]))
    return out


def target_probs(logits: torch.Tensor, rows: np.ndarray, batch: InputBatch) -> torch.Tensor:
    """The plain sampler's distribution for each logits row (``sampler.filtered_probs``:
    temperature, top-k, top-p, min-p), normalized: the acceptance ratios and the residual
    distribution need true probabilities. ``rows[i]``: the InputBatch row of logits row i."""
    probs = filtered_probs(logits, rows, batch)
    if (batch.min_p[rows] > 0).any():  # a min-p cut removed mass
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
