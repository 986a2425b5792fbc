"""The scheduler's LoRA rule (``max_loras``): never more distinct adapters among running
requests (hence in a step) than allowed; a request whose adapter would exceed it waits, is
overtaken at most ``max_bypass`` times, and finishes; every request keeps exact outputs.
Prefix-cache keys include the adapter."""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sched_helpers import EOS
from test_scheduler_properties import VOCAB, reference_output
from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.kv_cache.extra_keys import block_extra_key
from llmtower.core.request import Request, RequestStatus
from llmtower.core.sampling_params import SamplingParams
from llmtower.core.sched.scheduler import Scheduler
from llmtower.executor.fake_executor import FakeExecutor
from llmtower.lora.request import LoRARequest


def _lora(i: int) -> LoRARequest | None:
    return LoRARequest(f"adapter{i}", i, f"/adapters/{i}") if i else None


class LoRASchedulerMachine(RuleBasedStateMachine):
    @initialize(max_loras=st.integers(1, 3), policy=st.sampled_from(["fcfs", "priority", "sjf"]),
                mode=st.sampled_from(["recompute", "swap"]), budget=st.integers(4, 48),
                num_blocks=st.integers(6, 32), max_num_seqs=st.integers(1, 8),
                max_bypass=st.integers(0, 4), prefix=st.booleans())
    def setup(self, max_loras, policy, mode, budget, num_blocks, max_num_seqs, max_bypass,
              prefix):
        self.cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                   max_model_len=48, policy=policy, preemption_mode=mode,
                                   max_bypass=max_bypass, max_loras=max_loras)
        cache = CacheConfig(block_size=4, num_blocks=num_blocks, num_cpu_blocks=16,
                            enable_prefix_caching=prefix)
        self.s = Scheduler(self.cfg, cache)
        self.ex = FakeExecutor(num_blocks, 4, 16, vocab_size=VOCAB)
        self.next_id = 0
        self.expected: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.aborted: set[str] = set()
        self.work: dict[str, int] = {}

    @rule(adapter=st.integers(0, 5), prompt=st.lists(st.integers(1, VOCAB - 1), min_size=1,
                                                      max_size=14),
          max_tokens=st.integers(1, 12), priority=st.integers(0, 3), copies=st.integers(1, 4))
    def add(self, adapter, prompt, max_tokens, priority, copies):
        for _ in range(copies):
            rid = f"r{self.next_id}"
            self.next_id += 1
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            req = Request(rid, prompt, sp, eos_token_id=EOS,
                          priority=priority if self.cfg.policy == "priority" else 0,
                          lora_request=_lora(adapter))
            self.s.add_request(req)
            self.expected[rid] = reference_output(prompt, sp, req.max_tokens)
            self.outputs[rid] = []
            self.work[rid] = len(prompt) + req.max_tokens

    @rule()
    def step(self):
        so = self.s.schedule()
        adapters = {so.scheduled_requests[r].lora_request.lora_int_id
                    for r in so.num_scheduled_tokens
                    if so.scheduled_requests[r].lora_request is not None}
        assert len(adapters) <= self.cfg.max_loras, adapters
        for new in so.scheduled_new_reqs:  # the executor learns each request's adapter
            assert new.lora_request == self.s.requests[new.req_id].lora_request
        mro = self.ex.execute_model(so)
        for out in self.s.update_from_output(so, mro).outputs:
            self.outputs[out.request_id].extend(out.new_token_ids)

    @precondition(lambda self: bool(self.s.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.s.requests)))
        self.s.abort_requests([rid])
        self.aborted.add(rid)

    @invariant()
    def running_adapters_within_max_loras(self):
        if not hasattr(self, "s"):
            return
        running = {r.lora_request.lora_int_id for r in self.s.running if r.lora_request}
        assert len(running) <= self.cfg.max_loras

    def teardown(self):
        if not hasattr(self, "s"):
            return
        left = list(self.s.requests)
        # No starvation: every request left finishes within a bound of steps (see
        # test_scheduler_properties.py's teardown for the bound's reasoning).
        bound = (sum(self.work[r] for r in left) + 1) * (len(left) + 1)
        for _ in range(bound):
            if not self.s.has_unfinished_requests():
                break
            self.step()
        assert not self.s.has_unfinished_requests(), f"requests starved past {bound} steps"
        for rid, want in self.expected.items():
            got = self.outputs[rid]
            assert got == (want[:len(got)] if rid in self.aborted else want), rid


LoRASchedulerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("LLMTOWER_HYPOTHESIS_EXAMPLES", 300)) // 3,
    stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestLoRAScheduler = LoRASchedulerMachine.TestCase


def _sched(max_loras: int, max_bypass: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64,
                                     max_model_len=48, max_loras=max_loras,
                                     max_bypass=max_bypass),
                     CacheConfig(block_size=4, num_blocks=64))


def _req(rid: str, adapter: int, max_tokens: int = 8) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   lora_request=_lora(adapter))


def test_request_over_max_loras_waits_then_runs():
    s = _sched(max_loras=1)
    for r in (_req("a", 1), _req("b", 2), _req("base", 0), _req("a2", 1)):
        s.add_request(r)
    so = s.schedule()
    # b waits (adapter 2 would be the second); the base request and a2 share the step.
    assert list(so.num_scheduled_tokens) == ["a", "base", "a2"]
    assert s.requests["b"].status == RequestStatus.WAITING
    s.abort_requests(["a", "a2"])
    so = s.schedule()
    assert "b" in so.num_scheduled_tokens


def test_lora_blocked_request_overtaken_at_most_max_bypass_times():
    """Adapter-1 requests keep arriving behind a waiting adapter-2 one: after max_bypass of
    them went first, nobody else is admitted until it runs."""
    s = _sched(max_loras=1, max_bypass=2)
    s.add_request(_req("a", 1, max_tokens=3))
    s.schedule()
    s.add_request(_req("b", 2))
    for i in range(4):
        s.add_request(_req(f"a{i}", 1))
    so = s.schedule()
    # ("a" has nothing to compute until its step's output is applied.)
    assert list(so.num_scheduled_tokens) == ["a0", "a1"]
    assert s.requests["b"].status == RequestStatus.WAITING
    s.abort_requests(["a", "a0", "a1"])
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["b"]  # b first; a2, a3 wait for it


def test_prefix_cache_key_includes_adapter():
    base, one, two = _req("x", 0), _req("y", 1), _req("z", 2)
    keys = [block_extra_key(r) for r in (base, one, two)]
    assert len(set(keys)) == 3
    # A client's cache_salt can never equal an adapter's key.
    forged = Request("f", [1], SamplingParams(), cache_salt=block_extra_key(one))
    assert block_extra_key(forged) != block_extra_key(one)
