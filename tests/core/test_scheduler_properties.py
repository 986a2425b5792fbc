"""Stateful property tests: random configs and random add / step / abort sequences.

The fake model's next token is a deterministic function of the whole sequence, read back
from a fake KV cache through the block tables, so any mistake in block tables, swaps,
prefix-cache hits, chunking or recompute changes a request's tokens. Every request's tokens
must equal those of a run with unlimited memory and budget (computed here directly).
"""
from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sched_helpers import EOS
from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.errors import AdmissionError
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from llmtower.core.sched.scheduler import Scheduler
from llmtower.executor.fake_executor import FakeExecutor, fake_next_token

VOCAB = 40


def reference_output(prompt: list[int], sp: SamplingParams, max_tokens: int) -> list[int]:
    """What the fake model produces for this request alone, with unlimited resources."""
    seq, out = list(prompt), []
    while True:
        tok = fake_next_token(seq, VOCAB)
        seq.append(tok)
        out.append(tok)
        if len(out) >= sp.min_tokens:
            if tok == EOS and not sp.ignore_eos:
                return out
            if tok in sp.stop_token_ids:
                return out
        if len(out) >= max_tokens:
            return out


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(4, 24),
        num_cpu_blocks=st.integers(0, 30),
        policy=st.sampled_from(["fcfs", "priority", "sjf"]),
        mode=st.sampled_from(["recompute", "swap"]),
        chunked=st.booleans(),
        budget=st.integers(1, 48),
        threshold=st.integers(0, 12),
        partial=st.integers(1, 3),
        max_num_seqs=st.integers(1, 8),
        prefix=st.booleans(),
        max_bypass=st.integers(0, 4),
    )
    def setup(self, block_size, num_blocks, num_cpu_blocks, policy, mode, chunked, budget,
              threshold, partial, max_num_seqs, prefix, max_bypass):
        max_model_len = 48
        if not chunked:
            budget = max(budget, max_model_len)
        self.sched_cfg = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
            policy=policy, preemption_mode=mode, enable_chunked_prefill=chunked,
            long_prefill_token_threshold=threshold, max_num_partial_prefills=partial,
            max_bypass=max_bypass)
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                            num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=prefix)
        self.time = 0.0
        self.s = Scheduler(self.sched_cfg, cache, clock=lambda: self.time)
        self.ex = FakeExecutor(num_blocks, block_size, num_cpu_blocks, vocab_size=VOCAB)
        self.outputs: dict[str, list[int]] = {}
        self.expected: dict[str, list[int]] = {}
        self.aborted: set[str] = set()
        self.finished: set[str] = set()
        self.next_id = 0

    @rule(prefix_id=st.integers(0, 2), prefix_len=st.integers(0, 20),
          suffix=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=16),
          max_tokens=st.integers(1, 20), min_tokens=st.integers(0, 3),
          ignore_eos=st.booleans(), stop_ids=st.lists(st.integers(1, VOCAB - 1), max_size=2),
          priority=st.integers(0, 3))
    def add_one(self, **kw):
        self.add(**kw)

    def add(self, prefix_id, prefix_len, suffix, max_tokens, min_tokens, ignore_eos, stop_ids,
            priority):
        prompt = [prefix_id + 1] * prefix_len + suffix
        sp = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                            ignore_eos=ignore_eos, stop_token_ids=stop_ids)
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.time += 0.01
        req = Request(rid, prompt, sp, eos_token_id=EOS,
                      priority=priority if self.sched_cfg.policy == "priority" else 0,
                      arrival_time=self.time)
        try:
            self.s.add_request(req)
        except AdmissionError:
            return
        self.expected[rid] = reference_output(prompt, sp, req.max_tokens)
        self.outputs[rid] = []

    @rule(n=st.integers(2, 8), seed=st.integers(0, 2**16))
    def add_batch(self, n, seed):
        """Many requests at once, so that memory pressure and sharing are common."""
        import random
        rng = random.Random(seed)
        for _ in range(n):
            self.add(prefix_id=rng.randrange(3), prefix_len=rng.choice([0, 5, 12]),
                     suffix=[rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 10))],
                     max_tokens=rng.randrange(1, 16), min_tokens=rng.randrange(3),
                     ignore_eos=rng.random() < 0.5, stop_ids=[], priority=rng.randrange(4))

    @rule()
    def step(self):
        self._step()

    @precondition(lambda self: bool(self.s.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.s.requests)))
        self.s.abort_requests([rid, rid])
        self.aborted.add(rid)

    def _step(self):
        self.time += 0.01
        so = self.s.schedule()
        cfg = self.sched_cfg
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
        assert all(n > 0 for n in so.num_scheduled_tokens.values())
        if cfg.long_prefill_token_threshold and cfg.enable_chunked_prefill:
            assert all(n <= cfg.long_prefill_token_threshold or n == 1
                       for n in so.num_scheduled_tokens.values())
        mro = self.ex.execute_model(so)
        for out in self.s.update_from_output(so, mro).outputs:
            self.outputs[out.request_id].extend(out.new_token_ids)
            if out.finish_reason:
                self.finished.add(out.request_id)

    @invariant()
    def blocks_are_consistent(self):
        if not hasattr(self, "s"):
            return
        kv = self.s.kv
        used = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
        free = {b.block_id for b in kv.pool.free_queue}
        assert len(free) == kv.pool.num_free_blocks
        for b in kv.pool.blocks:
            assert b.ref_cnt == used.get(b.block_id, 0)
            assert (b.block_id in free) == (b.ref_cnt == 0)
        cpu_used = [c for cs in kv.req_to_cpu_blocks.values() for c in cs]
        assert len(set(cpu_used)) == len(cpu_used)
        assert not set(cpu_used) & set(kv.free_cpu_blocks)
        assert len(cpu_used) + len(kv.free_cpu_blocks) == kv.num_cpu_blocks
        assert len(self.s.running) <= self.sched_cfg.max_num_seqs
        for cached_hash, block in kv.pool.cached.items():
            assert block.block_hash == cached_hash

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for _ in range(5000):
            if not self.s.has_unfinished_requests():
                break
            self._step()
        assert not self.s.has_unfinished_requests(), "a request never finished"
        event(f"preempted={self.s.num_preemptions > 0} swapped={self.s.num_swap_outs > 0} "
              f"prefix_hits={self.s.kv.prefix_cache_hits > 0}")
        kv = self.s.kv
        assert kv.pool.num_free_blocks == kv.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
        assert not kv.req_to_blocks and len(kv.free_cpu_blocks) == kv.num_cpu_blocks
        assert not self.s.running and not self.s.swapped and len(self.s.waiting) == 0
        for rid, expected in self.expected.items():
            if rid in self.aborted:
                assert expected[:len(self.outputs[rid])] == self.outputs[rid]
            else:
                assert rid in self.finished
                assert self.outputs[rid] == expected, rid


SchedulerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get('LLMTOWER_HYPOTHESIS_EXAMPLES', 300)), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestScheduler = SchedulerMachine.TestCase
