"""Stateful property tests: random configs and random add / step / abort sequences.

The fake model's next token is a deterministic function of the whole sequence, read back
from a fake KV cache through the block tables, so any mistake in block tables, swaps,
prefix-cache hits, chunking or recompute changes a request's tokens. Every request's tokens
must equal those of a run with unlimited memory and budget (computed here directly).

Also exercised: ids of finished and aborted requests reused; two steps in flight (step N+1
scheduled and executed before step N's outputs are applied, so late outputs reach preempted,
aborted and finished requests); equal arrival times and ``n > 1`` fan-out; every policy and
both victim rules. Checked after every step: the step's prefill + decode counts equal its
scheduled tokens, never negative, and match a recount; the waiting queue's token count is the
sum over its requests; and in the end every request finishes within a bound of steps.

``LLMTOWER_HYPOTHESIS_EXAMPLES`` sets the number of examples (default 300).
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
        policy=st.sampled_from(["fcfs", "priority", "sjf", "fair"]),
        victim=st.sampled_from(["priority", "remaining"]),
        mode=st.sampled_from(["recompute", "swap"]),
        chunked=st.booleans(),
        budget=st.integers(1, 48),
        threshold=st.integers(0, 12),
        partial=st.integers(1, 3),
        max_num_seqs=st.integers(1, 8),
        prefix=st.booleans(),
        max_bypass=st.integers(0, 4),
    )
    def setup(self, block_size, num_blocks, num_cpu_blocks, policy, victim, mode, chunked, budget,
              threshold, partial, max_num_seqs, prefix, max_bypass):
        max_model_len = 48
        if not chunked:
            budget = max(budget, max_model_len)
        self.sched_cfg = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
            policy=policy, preemption_mode=mode, enable_chunked_prefill=chunked,
            long_prefill_token_threshold=threshold, max_num_partial_prefills=partial,
            max_bypass=max_bypass, preemption_victim=victim, tenant_weights={"t0": 2.0})
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                            num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=prefix)
        self.time = 0.0
        self.s = Scheduler(self.sched_cfg, cache, clock=lambda: self.time)
        self.ex = FakeExecutor(num_blocks, block_size, num_cpu_blocks, vocab_size=VOCAB)
        # Keyed by incarnation ("r3#0", "r3#1", ... when the id r3 is reused).
        self.outputs: dict[str, list[int]] = {}
        self.expected: dict[str, list[int]] = {}
        self.aborted: set[str] = set()
        self.finished: set[str] = set()
        self.current: dict[str, str] = {}  # live request id -> its incarnation
        self.free_ids: list[str] = []  # ids of finished / aborted requests, free for reuse
        self.incarnations: dict[str, int] = {}
        self.next_id = 0
        self.pending = None  # (SchedulerOutput, ModelRunnerOutput) of a step in flight
        self.num_steps = 0
        self.finished_at: dict[str, int] = {}
        self.born: dict[str, int] = {}  # incarnation -> step count at its arrival
        self.work: dict[str, int] = {}  # incarnation -> prompt + max_tokens

    @rule(prefix_id=st.integers(0, 2), prefix_len=st.integers(0, 20),
          suffix=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=16),
          max_tokens=st.integers(1, 20), min_tokens=st.integers(0, 3),
          ignore_eos=st.booleans(), stop_ids=st.lists(st.integers(1, VOCAB - 1), max_size=2),
          priority=st.integers(0, 3), reuse=st.booleans(), fanout=st.sampled_from([1, 1, 2, 4]))
    def add_one(self, reuse, fanout, **kw):
        """One request, or ``n > 1`` children: same prompt, params and arrival time."""
        self.time += 0.01
        for _ in range(fanout):
            self.add(**kw, reuse=reuse, tick=False)

    def _new_id(self, reuse: bool) -> str:
        if reuse and self.free_ids:
            return self.free_ids.pop(0)
        self.next_id += 1
        return f"r{self.next_id - 1}"

    def add(self, prefix_id, prefix_len, suffix, max_tokens, min_tokens, ignore_eos, stop_ids,
            priority, reuse=False, tick=True):
        prompt = [prefix_id + 1] * prefix_len + suffix
        sp = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                            ignore_eos=ignore_eos, stop_token_ids=stop_ids)
        rid = self._new_id(reuse)
        if tick:
            self.time += 0.01
        req = Request(rid, prompt, sp, eos_token_id=EOS,
                      priority=priority if self.sched_cfg.policy == "priority" else 0,
                      arrival_time=self.time, tenant=f"t{len(prompt) % 3}")
        try:
            self.s.add_request(req)
        except AdmissionError:
            self.free_ids.append(rid)
            return
        n = self.incarnations.get(rid, 0)
        self.incarnations[rid] = n + 1
        key = self.current[rid] = f"{rid}#{n}"
        self.expected[key] = reference_output(prompt, sp, req.max_tokens)
        self.outputs[key] = []
        self.born[key] = self.num_steps
        self.work[key] = len(prompt) + req.max_tokens

    @rule(n=st.integers(2, 8), seed=st.integers(0, 2**16))
    def add_batch(self, n, seed):
        """Many requests at once, so that memory pressure and sharing are common."""
        import random
        rng = random.Random(seed)
        for _ in range(n):
            self.add(prefix_id=rng.randrange(3), prefix_len=rng.choice([0, 5, 12]),
                     suffix=[rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 10))],
                     max_tokens=rng.randrange(1, 16), min_tokens=rng.randrange(3),
                     ignore_eos=rng.random() < 0.5, stop_ids=[], priority=rng.randrange(4),
                     reuse=rng.random() < 0.3)

    @rule()
    def step(self):
        self._step()

    @rule()
    def step_ahead(self):
        """Schedule and execute the next step before the outputs of this one are applied."""
        self._step(ahead=True)

    @precondition(lambda self: bool(self.s.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.s.requests)))
        self.s.abort_requests([rid, rid])
        self._gone(rid)
        self.aborted.add(self.current.pop(rid))

    def _gone(self, rid: str) -> None:
        self.free_ids.append(rid)

    def _apply(self, so, mro) -> None:
        for out in self.s.update_from_output(so, mro).outputs:
            key = self.current[out.request_id]
            self.outputs[key].extend(out.new_token_ids)
            if out.finish_reason:
                self.finished.add(key)
                self.finished_at[key] = self.num_steps
                del self.current[out.request_id]
                self._gone(out.request_id)

    def _step(self, ahead: bool = False):
        self.time += 0.01
        self.num_steps += 1
        so = self.s.schedule()
        self._check_step(so)
        mro = self.ex.execute_model(so)
        if self.pending is not None:
            self._apply(*self.pending)
            self.pending = None
        if ahead:
            self.pending = (so, mro)
        else:
            self._apply(so, mro)

    def _check_step(self, so) -> None:
        cfg = self.sched_cfg
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
        assert all(n > 0 for n in so.num_scheduled_tokens.values())
        if cfg.long_prefill_token_threshold and cfg.enable_chunked_prefill:
            assert all(n <= cfg.long_prefill_token_threshold or n == 1
                       for n in so.num_scheduled_tokens.values())
        # The step's prefill / decode split: never negative, adds up, and matches a recount.
        assert so.num_prefill_tokens >= 0 and so.num_decode_tokens >= 0
        assert so.num_prefill_tokens + so.num_decode_tokens == so.total_num_scheduled_tokens
        decode = 0
        for rid, n in so.num_scheduled_tokens.items():
            req = so.scheduled_requests[rid]
            assert req is self.s.requests[rid]
            before = req.num_computed_tokens - n
            if before + 1 == req.num_tokens > req.num_prompt_tokens:
                decode += n
        assert decode == so.num_decode_tokens
        stats = self.s.get_stats()
        assert stats.last_step_num_prefill_tokens == so.num_prefill_tokens

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

    @invariant()
    def waiting_queue_counts_are_exact(self):
        if not hasattr(self, "s"):
            return
        waiting = list(self.s.waiting)
        assert len(waiting) == len(self.s.waiting)
        assert self.s.waiting.num_tokens == sum(r.num_tokens for r in waiting)
        assert len({id(r) for r in waiting}) == len(waiting)
        assert all(self.s.requests.get(r.request_id) is r for r in waiting)

    def teardown(self):
        if not hasattr(self, "s"):
            return
        if self.pending is not None:
            self._apply(*self.pending)
            self.pending = None
        # No starvation: with no new arrivals, every request left finishes within a bound
        # derived from the config and the work left. Without preemption each step moves the
        # most protected running request forward by >= 1 token, so W steps (W = prompt +
        # max_tokens summed over the requests left) would do; a recompute wastes at most one
        # request's length, and under a strict victim order each of the N requests is
        # displaced only by the ones ranked above it, hence the (N + 1) factor. A livelock
        # (two requests preempting each other forever) exceeds any bound.
        left = [self.current[rid] for rid in self.s.requests]
        bound = (sum(self.work[k] for k in left) + 1) * (len(left) + 1)
        start = self.num_steps
        while self.s.has_unfinished_requests() and self.num_steps - start <= bound:
            self._step()
        assert not self.s.has_unfinished_requests(), f"requests starved past {bound} steps"
        event(f"drain steps / work left: {(self.num_steps - start) / max(1, bound / (len(left) + 1)):.1f}")
        event(f"preempted={self.s.num_preemptions > 0} swapped={self.s.num_swap_outs > 0} "
              f"prefix_hits={self.s.kv.prefix_cache_hits > 0}")
        kv = self.s.kv
        assert kv.pool.num_free_blocks == kv.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
        assert not kv.req_to_blocks and len(kv.free_cpu_blocks) == kv.num_cpu_blocks
        assert not self.s.running and not self.s.swapped and len(self.s.waiting) == 0
        for key, expected in self.expected.items():
            if key in self.aborted:
                assert expected[:len(self.outputs[key])] == self.outputs[key]
            else:
                assert key in self.finished
                assert self.outputs[key] == expected, key


SchedulerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get('LLMTOWER_HYPOTHESIS_EXAMPLES', 300)), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestScheduler = SchedulerMachine.TestCase
