"""The AsyncScheduler (--async-scheduling) over the model-free fake executor, which keeps its
own per-request tokens and reads them back through a fake paged KV cache: output placeholders,
late stop checks, preemption and aborts while a step is in flight, all compared token for token
with the serial engine. Random workloads: LLMTOWER_ASYNC_SCHED_SEEDS (default 12) seeds."""
from __future__ import annotations

import os
import random
import threading
import time

import pytest

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from llmtower.core.sched.async_scheduler import AsyncScheduler
from llmtower.core.sched.scheduler import Scheduler
from llmtower.engine.batch_queue import BatchQueue
from llmtower.engine.core import EngineCore
from llmtower.executor.fake_executor import FakeExecutor

EOS = 0
VOCAB = 48  # small: the fake model hits EOS and stop ids often
SEEDS = int(os.environ.get("LLMTOWER_ASYNC_SCHED_SEEDS", "12"))


def make_engine(async_scheduling: bool, num_blocks: int = 64, num_cpu_blocks: int = 0,
                block_size: int = 4, kv_allocator: str = "plain", **sched_kw) -> EngineCore:
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                        num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=True,
                        kv_allocator=kv_allocator)  # type: ignore[arg-type]
    sched_kw.setdefault("max_model_len", 96)
    cls = AsyncScheduler if async_scheduling else Scheduler
    return EngineCore(cls(SchedulerConfig(**sched_kw), cache),
                      FakeExecutor(num_blocks, block_size, num_cpu_blocks, VOCAB))


def request(rid: str, prompt: list[int], **sp) -> Request:
    sp.setdefault("max_tokens", 16)
    return Request(rid, prompt, SamplingParams(**sp), eos_token_id=EOS)


class Run:
    """Steps an engine to the end, recording every output and checking that nothing arrives
    for a request after its finish or its abort."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.closed: set[str] = set()

    def step(self) -> None:
        for o in self.engine.step().outputs:
            assert o.request_id not in self.closed, f"output for {o.request_id} after its end"
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                self.finish[o.request_id] = o.finish_reason
                self.closed.add(o.request_id)

    def abort(self, rids: list[str]) -> None:
        for rid in self.engine.abort_requests(rids):
            self.closed.add(rid)

    def drain(self, max_steps: int = 20_000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")


def assert_all_free(engine: EngineCore) -> None:
    s = engine.scheduler
    assert not s.requests and not s.running and not s.swapped and len(s.waiting) == 0
    assert not s.kv.req_to_blocks and not s.kv.req_to_cpu_blocks
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)


def test_placeholder_lets_the_next_step_decode_a_token_not_seen_yet():
    engine = make_engine(True)
    sched = engine.scheduler
    req = request("a", [5, 6, 7], max_tokens=4, ignore_eos=True)
    sched.add_request(req)
    first = sched.schedule()  # the prefill: it samples token 3
    assert first.num_scheduled_tokens == {"a": 3} and first.placeholder_req_ids == ["a"]
    assert req.num_output_placeholders == 1 and req.num_tokens == 3
    # Scheduled before the prefill's output is known: a decode of the placeholder.
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"a": 1} and req.num_output_placeholders == 2
    out1 = engine.executor.execute_model(first)
    out2 = engine.executor.execute_model(second)
    sched.update_from_output(first, out1)
    assert req.num_output_placeholders == 1 and req.num_tokens == 4
    sched.update_from_output(second, out2)
    assert req.num_output_placeholders == 0 and req.num_tokens == 5
    assert req.output_token_ids == out1.sampled_token_ids[0] + out2.sampled_token_ids[0]


def test_max_tokens_never_schedules_past_the_last_token():
    """The step in flight samples the last token by length: no step is scheduled after it
    (the fake executor would otherwise get a decode for a token past max_tokens)."""
    engine = make_engine(True)
    sched = engine.scheduler
    req = request("a", [5, 6, 7], max_tokens=1, ignore_eos=True)
    sched.add_request(req)
    first = sched.schedule()
    assert first.placeholder_req_ids == ["a"]
    assert sched.schedule().num_scheduled_tokens == {}
    outs = sched.update_from_output(first, engine.executor.execute_model(first))
    assert [(len(o.new_token_ids), o.finish_reason) for o in outs.outputs] == [(1, "length")]
    assert req.num_output_placeholders == 0 and not sched.requests


def test_first_async_step_leaves_a_step_in_flight_and_overlaps_the_next():
    """While step N's forward pass runs (on the worker thread), step N+1 is scheduled."""
    threads: list[str] = []

    def slow_token(_rid: str, _seq: list[int]) -> int:
        threads.append(threading.current_thread().name)
        time.sleep(0.05)
        return 7

    engine = make_engine(True)
    engine.executor = FakeExecutor(64, 4, 0, VOCAB, token_fn=slow_token)
    engine.batch_queue = BatchQueue(engine.executor)
    engine.scheduler.add_request(request("a", [1, 2, 3, 4, 5], max_tokens=3, ignore_eos=True))
    assert engine.step().outputs == []  # step 1 submitted, not waited for
    assert len(engine.batch_queue) == 1 and engine.scheduler.num_steps == 1
    out = engine.step()  # step 2 scheduled and submitted behind step 1, then step 1 applied
    assert engine.scheduler.num_steps == 2 and len(engine.batch_queue) == 1
    assert [o.new_token_ids for o in out.outputs] == [[7]]
    run = Run(engine)
    run.drain()
    assert run.tokens == {"a": [7, 7]} and run.finish == {"a": "length"}
    assert threads and all(t.startswith("llmtower-forward") for t in threads)
    engine.shutdown()


def _workload(rng: random.Random, n: int) -> list[tuple[str, list[int], dict]]:
    shared = [rng.randrange(1, VOCAB) for _ in range(rng.choice([4, 8, 9]))]
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))]
        if rng.random() < 0.4:
            prompt = shared + prompt  # prefix-cache hits, also within one step
        sp: dict = {"max_tokens": rng.randint(1, 24)}
        if rng.random() < 0.5:
            sp["ignore_eos"] = True
        if rng.random() < 0.4:
            sp["stop_token_ids"] = rng.sample(range(1, VOCAB), 2)
        if rng.random() < 0.2:
            sp["min_tokens"] = min(sp["max_tokens"], rng.randint(1, 4))
        reqs.append((f"r{i}", prompt, sp))
    return reqs


def _run_workload(async_scheduling: bool, reqs, engine_kw: dict, aborts: dict[int, list[str]],
                  arrivals: dict[int, list[int]]) -> Run:
    engine = make_engine(async_scheduling, **engine_kw)
    run = Run(engine)
    pending = {i for i in range(len(reqs))}
    for step in range(20_000):
        for i in arrivals.get(step, []):
            rid, prompt, sp = reqs[i]
            engine.scheduler.add_request(request(rid, prompt, **sp))
            pending.discard(i)
        if step in aborts:
            run.abort(aborts[step])
        if not pending and not engine.has_unfinished_requests():
            break
        run.step()
    else:
        raise AssertionError("requests did not finish")
    assert_all_free(engine)
    engine.shutdown()
    return run


ENGINE_VARIANTS = [
    pytest.param(dict(num_blocks=20, max_num_batched_tokens=16), id="recompute-chunked"),
    pytest.param(dict(num_blocks=20, num_cpu_blocks=64, preemption_mode="swap",
                      max_num_batched_tokens=24), id="swap"),
    pytest.param(dict(num_blocks=24, kv_allocator="relocator", max_num_batched_tokens=32),
                 id="relocator"),
    pytest.param(dict(num_blocks=24, policy="priority", max_num_seqs=4), id="priority-max-seqs"),
]


@pytest.mark.parametrize("engine_kw", ENGINE_VARIANTS)
def test_random_workloads_give_the_serial_engines_tokens(engine_kw):
    """Arrivals over time, preemptions (small KV), prefix hits, EOS / stop ids / max_tokens /
    min_tokens, and aborts (some while their step is in flight): the same outputs, the same
    finish reasons, every block free at the end."""
    preempted = 0
    for seed in range(SEEDS):
        rng = random.Random(seed)
        reqs = _workload(rng, rng.randint(4, 14))
        arrivals: dict[int, list[int]] = {}
        for i in range(len(reqs)):
            arrivals.setdefault(rng.choice([0, 0, 1, 3, 7, 12]), []).append(i)
        # Aborts only in the first steps, of requests that have surely arrived and not
        # finished in either engine: the serial and async engines abort the same work.
        aborts = {2: [reqs[i][0] for i in arrivals.get(0, [])[:1]]}
        sync = _run_workload(False, reqs, engine_kw, aborts, arrivals)
        asyn = _run_workload(True, reqs, engine_kw, aborts, arrivals)
        aborted = set(aborts[2])
        for rid, _, _ in reqs:
            if rid in aborted:
                continue
            assert asyn.tokens.get(rid) == sync.tokens.get(rid), (seed, rid)
            assert asyn.finish.get(rid) == sync.finish.get(rid), (seed, rid)
        preempted += sync.engine.scheduler.num_preemptions
    if engine_kw.get("num_blocks", 64) <= 20:
        assert preempted > 0  # the workloads did preempt


def test_abort_and_id_reuse_while_the_step_is_in_flight():
    """Aborted with a step in flight: nothing more is reported for it, its blocks are free at
    once, and a new request reusing its id gets its own tokens (the serial engine's)."""
    reqs = [request(f"r{i}", [3 + i, 9, 4, 11 + i, 7], max_tokens=20, ignore_eos=True)
            for i in range(4)]
    engine = make_engine(True, num_blocks=32)
    for r in reqs:
        engine.scheduler.add_request(r)
    run = Run(engine)
    for _ in range(5):
        run.step()
    assert engine.batch_queue is not None and len(engine.batch_queue) == 1
    in_flight = set(engine.batch_queue._in_flight[0][0].num_scheduled_tokens)
    assert {"r0", "r1"} <= in_flight
    run.abort(["r0", "r1"])
    kv = engine.scheduler.kv
    assert "r0" not in kv.req_to_blocks and "r1" not in kv.req_to_blocks
    held = sum(len(b) for b in kv.req_to_blocks.values())
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - held
    reused = request("r0", [40, 41, 42], max_tokens=6, ignore_eos=True)
    engine.scheduler.add_request(reused)
    run.closed.discard("r0")
    run.tokens["r0"] = []
    run.drain()
    assert_all_free(engine)
    ref = make_engine(False)
    ref.scheduler.add_request(request("x", [40, 41, 42], max_tokens=6, ignore_eos=True))
    for r in [request(f"r{i}", [3 + i, 9, 4, 11 + i, 7], max_tokens=20, ignore_eos=True)
              for i in (2, 3)]:
        ref.scheduler.add_request(r)
    ref_run = Run(ref)
    ref_run.drain()
    assert run.tokens["r0"] == ref_run.tokens["x"]
    assert run.tokens["r2"] == ref_run.tokens["r2"] and run.tokens["r3"] == ref_run.tokens["r3"]
    # The runner dropped the aborted rows when the next step told it.
    assert not {"r1"} & set(engine.executor.reqs)
