"""The model runner's side of speculative decoding, in one place so the runner only calls it.

Per step, around the runner's own forward pass:
  1. ``begin``: forget finished requests; write each scheduled request's draft tokens into its
     row after its real tokens (so the flat batch reads them as input ids) and return how many
     each request has;
  2. the runner builds the flat batch counting the drafts, and ``logits_indices`` asks for the
     logits of every draft position (``expand_logits_indices``): request r with k drafts gets
     k + 1 rows (its last real token and each draft);
  3. ``sample``: requests without drafts go through the plain sampler; the others through the
     rejection sampler; accepted tokens are appended to the rows, the rows' progress is rolled
     back past the rejected drafts and block tables drop the blocks that held only rejected
     tokens (the scheduler frees the same blocks: ``blocks_for_tokens``); then the proposer
     drafts the next tokens of every sampled request, as many as the adaptive length allows
     (cost-aware: ``step_cost.StepCostModel`` times each step from ``begin`` to ``sample``).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from llmtower.core.outputs import LogprobsEntry, ModelRunnerOutput, SchedulerOutput
from llmtower.executor.input_batch import InputBatch
from llmtower.executor.rejection_sampler import RejectionSampler
from llmtower.executor.sampler import Sampler
from llmtower.spec_decode.adaptive import AdaptiveDraftLength
from llmtower.spec_decode.batch_gate import BatchDraftGate
from llmtower.spec_decode.config import SpeculativeConfig
from llmtower.spec_decode.proposer import Proposer, make_proposer
from llmtower.spec_decode.step_cost import StepCostModel
from llmtower.utils import cdiv


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """KV blocks a request keeps after a verification: those of its real tokens. The
    scheduler and the runner both trim to this, so their block tables stay equal."""
    return cdiv(num_tokens, block_size)


def expand_logits_indices(last_rows: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Flat-batch rows to take logits from: for each sampled request, its last k + 1 rows."""
    counts = num_drafts + 1
    starts = np.repeat(last_rows - num_drafts, counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return starts + within


def _can_verify(batch: InputBatch, row: int, num_tokens: int) -> bool:
    """Whether the rejection sampler reproduces this row's sampler exactly at every draft
    position. Penalties depend on every token before the position, min_tokens masks stop
    tokens until enough outputs exist, logprobs are reported per sampled token and a logit
    bias changes the distribution: such requests decode without drafts (min_tokens only until
    it is reached)."""
    return (batch.presence_penalty[row] == 0.0 and batch.frequency_penalty[row] == 0.0
            and batch.repetition_penalty[row] == 1.0 and batch.num_logprobs[row] < 0
            and num_tokens - batch.num_prompt_tokens[row] >= batch.min_tokens[row]
            and row not in getattr(batch, "logit_bias", ()))


class SpecDecodeStep:
    """Owns the proposer, the per-request adaptive draft lengths and the rejection sampler."""

    def __init__(self, config: SpeculativeConfig, sampler: Sampler, max_model_len: int,
                 proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.adaptive = AdaptiveDraftLength(config.num_speculative_tokens,
                                            config.adaptive_min_acceptance, config.adaptive)
        self.sampler = sampler
        self.rejection = RejectionSampler(sampler.generator)
        self.max_model_len = max_model_len
        # A model-based proposer (draft model) follows every forward pass and drafts from the
        # runner's rows; the others draft from token histories.
        self.needs_batch = bool(getattr(self.proposer, "needs_batch", False))
        self.cost = StepCostModel()
        self._step_start = 0.0
        # Whether the batch drafts at all (batch_gate.py), the requests whose drafts were
        # asked for last step (only they are judged) and drafting's host seconds per step.
        self.gate = BatchDraftGate(config.adaptive and config.batch_gate)
        self._asked: set[str] = set()
        self._host_s = 0.0

    # ------------------------------------------------------------------ before the forward
    def begin(self, so: SchedulerOutput, req_ids: list[str], batch: InputBatch) -> np.ndarray:
        self._step_start = time.perf_counter()
        if self.needs_batch:
            self.proposer.begin(so)  # type: ignore[attr-defined]  # draft cache block moves
        for rid in so.finished_req_ids:
            self.proposer.remove(rid)
            self.adaptive.remove(rid)
            self.gate.remove(rid)
        num_spec = np.zeros(len(req_ids), dtype=np.int64)
        spec = so.scheduled_spec_decode_tokens
        if spec:
            index = {rid: i for i, rid in enumerate(req_ids)}
            r2r = batch.req_id_to_row
            for rid, draft in spec.items():
                if not draft:
                    continue
                row = r2r[rid]
                n = int(batch.num_tokens[row])
                if n + len(draft) > self.max_model_len:
                    raise RuntimeError(f"request {rid!r}: {len(draft)} draft tokens after {n} "
                                       f"tokens pass max_model_len={self.max_model_len}")
                batch.token_ids[row, n:n + len(draft)] = draft
                num_spec[index[rid]] = len(draft)
        return num_spec

    # ------------------------------------------------------------------ after the forward
    def sample(self, so: SchedulerOutput, logits: torch.Tensor, req_ids: list[str],
               inputs: Any, num_spec: np.ndarray, batch: InputBatch,
               block_size: int) -> ModelRunnerOutput:
        """``logits``: k_i + 1 rows per sampled request (in ``req_ids`` order); ``inputs``
        the runner's ``StepInputs``; ``num_spec`` drafts per scheduled request."""
        # The forward pass just ended: its cost sets what a draft row must earn next step.
        self.cost.observe(int(inputs.meta.num_tokens), time.perf_counter() - self._step_start)
        self.adaptive.set_min_acceptance(self.cost.min_acceptance(len(req_ids)))
        if self.needs_batch:
            self.proposer.observe_step(inputs.input_ids, inputs.positions,  # type: ignore[attr-defined]
                                       inputs.meta)
        sample_mask, rows = inputs.sample_mask, inputs.sample_rows
        k = num_spec[sample_mask]
        counts = k + 1
        offsets = np.cumsum(counts) - counts
        sampled_idx = np.flatnonzero(sample_mask)
        results: list[list[int]] = [[] for _ in range(len(rows))]
        plain = np.flatnonzero(k == 0)
        plain_lp = None
        if plain.size:
            # No drafts in the step (the gate closed, the common case where nothing is
            # copied): the logits rows are the plain ones already; a gather would copy them.
            plain_logits = (logits if plain.size == len(k) == logits.shape[0]
                            else logits[torch.from_numpy(offsets[plain])])
            tokens, plain_lp = self.sampler(plain_logits, rows[plain], batch)
            for j, t in zip(plain.tolist(), tokens.tolist()):
                results[j] = [t]
        drafted = np.flatnonzero(k > 0)
        t_host = time.perf_counter()
        if drafted.size:
            spec = so.scheduled_spec_decode_tokens
            drafts = [spec[req_ids[sampled_idx[j]]] for j in drafted.tolist()]
            q = None
            if self.needs_batch:  # drafts drawn from the draft model's own distribution
                q = [self.proposer.draft_probs(req_ids[sampled_idx[j]], len(d))  # type: ignore[attr-defined]
                     for j, d in zip(drafted.tolist(), drafts)]
            accepted = self.rejection(logits, offsets[drafted], drafts, rows[drafted], batch, q)
            for j, toks, d in zip(drafted.tolist(), accepted, drafts):
                results[j] = toks
                self.adaptive.observe(req_ids[sampled_idx[j]], len(d), len(toks) - 1,
                                      independent=int(rows[j]) in batch.generators)
        self._append(results, rows, k, batch, block_size)
        gate_open = self._judge(req_ids, sampled_idx, results, k, so)
        # A grammar constrains one position per step (its bitmask): no drafts under it.
        constrained = getattr(so, "structured_output_request_ids", None) or {}
        spec_out = self._propose(req_ids, sampled_idx, rows, batch, constrained, gate_open)
        if drafted.size or gate_open:  # drafting's host time: verifying and proposing
            self._host_s = 0.7 * self._host_s + 0.3 * (time.perf_counter() - t_host)
        return self._output(req_ids, sampled_idx, results, plain, plain_lp, spec_out)

    def _judge(self, req_ids: list[str], sampled_idx: np.ndarray, results: list[list[int]],
               k: np.ndarray, so: SchedulerOutput) -> bool:
        """Feed the step's outcome to the batch gate and ask it whether the batch drafts next."""
        gate, asked = self.gate, self._asked
        sampled = [req_ids[i] for i in sampled_idx.tolist()]
        for j, rid in enumerate(sampled):
            if rid in asked:  # only requests whose drafts were asked for are judged
                kj = int(k[j])
                gate.observe(rid, kj, len(results[j]) - 1 if kj else 0)
        per_row = self.cost.per_row_seconds()
        host_rows = self._host_s / per_row if per_row > 0.0 else 0.0
        return gate.step(sampled, self.cost.fixed_rows(), host_rows,
                         so.num_waiting_reqs)

    def _append(self, results: list[list[int]], rows: np.ndarray, k: np.ndarray,
                batch: InputBatch, block_size: int) -> None:
        max_len = self.max_model_len
        for j, toks in enumerate(results):
            row = int(rows[j])
            n = int(batch.num_tokens[row])
            m = min(len(toks), max_len - n)
            if m > 0:
                batch.token_ids[row, n:n + m] = toks[:m]
            batch.num_tokens[row] = n + max(m, 0)
            kj = int(k[j])
            if kj:
                rejected = kj + 1 - len(toks)
                batch.num_computed_tokens[row] -= rejected
                keep = blocks_for_tokens(int(batch.num_tokens[row]), block_size)
                if keep < batch.num_blocks[row]:
                    batch.num_blocks[row] = keep

    def _propose(self, req_ids: list[str], sampled_idx: np.ndarray, rows: np.ndarray,
                 batch: InputBatch, constrained: Any = (), gate_open: bool = True
                 ) -> list[list[int]]:
        ids, hists, ks, prompts, where = [], [], [], [], []
        idle: list[tuple[str, np.ndarray, int]] = []  # not drafting now: index update only
        asked = self._asked
        asked.clear()
        for j, i in enumerate(sampled_idx.tolist()):
            row = int(rows[j])
            n = int(batch.num_tokens[row])
            if batch.needs_processing[row] and not _can_verify(batch, row, n):
                continue
            rid = req_ids[i]
            if rid in constrained:
                continue
            # A seeded sampled request's tokens depend on its drafts: their length must not
            # depend on the batch or the clock (cost-aware lengths), only on its own history.
            independent = row in batch.generators
            if not (gate_open or independent or self.gate.solo(rid)):
                idle.append((rid, batch.token_ids[row, :n], int(batch.num_prompt_tokens[row])))
                continue
            asked.add(rid)
            kk = min(self.adaptive.num_drafts(rid, independent=independent),
                     self.max_model_len - n)
            if self.needs_batch and n + self.config.num_speculative_tokens > self.max_model_len:
                kk = 0  # the draft loop runs every request K positions ahead
            if kk <= 0:
                idle.append((rid, batch.token_ids[row, :n], int(batch.num_prompt_tokens[row])))
                continue
            ids.append(rid)
            hists.append(batch.token_ids[row, :n])
            ks.append(kk)
            prompts.append(int(batch.num_prompt_tokens[row]))
            where.append(i)
        out: list[list[int]] = [[] for _ in req_ids]
        # A proposer that indexes each request's tokens (suffix) keeps its index current for
        # the requests it does not draft for, so a finished request's whole output is kept.
        track = getattr(self.proposer, "track", None)
        if idle and track is not None:
            track([x[0] for x in idle], [x[1] for x in idle], [x[2] for x in idle])
        if ids:
            if self.needs_batch:
                rows_l = [int(batch.req_id_to_row[r]) for r in ids]
                drafts = self.proposer.propose_from_batch(ids, rows_l, ks, batch)  # type: ignore[attr-defined]
            else:
                drafts = self.proposer.propose(ids, hists, ks, prompts)
            for i, d in zip(where, drafts):
                out[i] = d
        return out

    @staticmethod
    def _output(req_ids: list[str], sampled_idx: np.ndarray, results: list[list[int]],
                plain: np.ndarray, plain_lp: list[LogprobsEntry | None] | None,
                spec_out: list[list[int]]) -> ModelRunnerOutput:
        sampled: list[list[int]] = [[] for _ in req_ids]
        for j, i in enumerate(sampled_idx.tolist()):
            sampled[i] = results[j]
        out_lp: list[list[LogprobsEntry]] | None = None
        if plain_lp is not None:
            out_lp = [[] for _ in req_ids]
            for j, e in zip(plain.tolist(), plain_lp):
                if e is not None:
                    out_lp[int(sampled_idx[j])].append(e)
        return ModelRunnerOutput(req_ids, sampled, out_lp, spec_token_ids=spec_out)
