"""Structured outputs coupled with the scheduler, on the fake executor (which obeys the
grammar bitmask): compile off the busy loop, WAITING_FOR_GRAMMAR, cache, timeouts, aborts,
preemption, jump-forward."""
from __future__ import annotations

import json
import re
import threading

from so_helpers import EOS, make_engine, make_manager, request, run, text_of

from llmtower.core.request import RequestStatus

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"]}
PROMPTS = [[10 + i, 20 + i, 30 + i, 40, 50, 60] for i in range(8)]


def _check_schema(text: str) -> dict:
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "tags"} and isinstance(obj["name"], str)
    assert len(obj["name"]) <= 6 and 0 <= obj["age"] <= 99
    assert set(obj["tags"]) <= {"a", "b"} and len(obj["tags"]) <= 3
    return obj


def test_constrained_outputs_are_valid_and_unconstrained_ones_unaffected(tokenizer):
    engine = make_engine(tokenizer)
    for i, p in enumerate(PROMPTS):
        engine.add_request(_ecr(f"plain{i}", p))
    alone, _, _ = run(engine)

    engine = make_engine(tokenizer)
    for i, p in enumerate(PROMPTS):
        engine.scheduler.add_request(request(f"json{i}", p, {"json": SCHEMA}, max_tokens=200))
        engine.scheduler.add_request(request(f"re{i}", p, {"regex": r"[a-z]{2,5}-\d\d"}))
        engine.scheduler.add_request(request(f"ch{i}", p, {"choice": ["yes", "no", "maybe"]}))
        engine.add_request(_ecr(f"plain{i}", p))
    out, finish, errors = run(engine)
    assert not errors
    for i in range(len(PROMPTS)):
        assert finish[f"json{i}"] == "stop" and out[f"json{i}"][-1] == EOS
        _check_schema(text_of(tokenizer, out[f"json{i}"]))
        assert re.fullmatch(r"[a-z]{2,5}-\d\d", text_of(tokenizer, out[f"re{i}"]))
        assert text_of(tokenizer, out[f"ch{i}"]) in {"yes", "no", "maybe"}
        assert out[f"plain{i}"] == alone[f"plain{i}"]  # mixing in grammars changes nothing
    assert engine.scheduler.structured_output.num_compiles == 3  # one per distinct grammar


def _ecr(rid, prompt, **sp):
    from llmtower.core.outputs import EngineCoreRequest
    from llmtower.core.sampling_params import SamplingParams
    return EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=12, ignore_eos=True, **sp),
                             eos_token_id=EOS)


def test_waiting_for_grammar_blocks_nobody_and_shares_one_compile(tokenizer):
    gate = threading.Event()
    engine = make_engine(tokenizer, manager=make_manager(tokenizer, gate=gate))
    sched = engine.scheduler
    sched.add_request(request("c1", PROMPTS[0], {"json": SCHEMA}, max_tokens=200))
    sched.add_request(request("c2", PROMPTS[1], {"json": SCHEMA}, max_tokens=200))
    engine.add_request(_ecr("plain", PROMPTS[2]))
    assert sched.requests["c1"].status == RequestStatus.WAITING_FOR_GRAMMAR
    steps = 0
    while "plain" in sched.requests:  # the unconstrained request runs to its end meanwhile
        engine.step()
        steps += 1
    assert steps >= 12 and sched.requests["c2"].status == RequestStatus.WAITING_FOR_GRAMMAR
    assert sched.get_stats().num_waiting_reqs == 2
    gate.set()
    out, finish, errors = run(engine)
    assert not errors and finish == {"c1": "stop", "c2": "stop"}
    _check_schema(text_of(tokenizer, out["c1"]))
    m = sched.structured_output
    assert m.num_compiles == 1 and m.num_cache_hits == 1


def test_compile_timeout_fails_only_that_request_and_leaks_nothing(tokenizer):
    gate = threading.Event()
    manager = make_manager(tokenizer, gate=gate, compile_timeout_s=0.05)
    engine = make_engine(tokenizer, manager=manager)
    engine.scheduler.add_request(request("slow", PROMPTS[0], {"regex": "[ab]+"}))
    engine.add_request(_ecr("plain", PROMPTS[1]))
    out, finish, errors = run(engine)
    gate.set()
    assert [rid for rid, _ in errors] == ["slow"]
    assert "did not compile within 0.05 s" in errors[0][1]
    assert finish == {"plain": "length"} and len(out["plain"]) == 12
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and not engine.scheduler.requests


def test_abort_while_waiting_for_grammar(tokenizer):
    gate = threading.Event()
    engine = make_engine(tokenizer, manager=make_manager(tokenizer, gate=gate))
    sched = engine.scheduler
    sched.add_request(request("c", PROMPTS[0], {"choice": ["x", "y"]}))
    assert sched.abort_requests(["c"]) == ["c"]
    assert not sched.requests and not sched.waiting_for_grammar
    gate.set()
    assert not engine.has_unfinished_requests()


def test_a_grammar_that_fails_to_compile_is_a_request_error(tokenizer):
    # Refused at admission if the compile already failed, else reported after it (both 400s).
    engine = make_engine(tokenizer)
    sched = engine.scheduler
    try:
        sched.add_request(request("bad1", PROMPTS[0], {"grammar": "root ::= \"a\" | "}))
    except ValueError as e:
        errors = [("bad1", str(e))]
    else:
        _, _, errors = run(engine)
    assert errors and errors[0][0] == "bad1" and "EBNF grammar has an error" in errors[0][1]
    assert not sched.requests and not sched.waiting_for_grammar


def test_preemption_by_recompute_never_advances_a_matcher_twice(tokenizer):
    # A KV cache so small that requests are preempted (recompute) while they generate:
    # the outputs must equal an unpressured run's, and every one must still be valid JSON.
    def run_with(num_blocks):
        engine = make_engine(tokenizer, num_blocks=num_blocks, block_size=4)
        for i, p in enumerate(PROMPTS):
            engine.scheduler.add_request(request(f"j{i}", p, {"json": SCHEMA}, max_tokens=120))
        out, finish, errors = run(engine)
        return out, finish, engine.scheduler.num_preemptions

    calm, finish, n0 = run_with(512)
    tight, finish2, n1 = run_with(40)
    assert n0 == 0 and n1 > 0
    assert tight == calm and finish2 == finish
    for toks in tight.values():
        _check_schema(text_of(tokenizer, toks))


def test_swap_preemption_keeps_grammars(tokenizer):
    engine = make_engine(tokenizer, num_blocks=40, num_cpu_blocks=200, preemption_mode="swap")
    for i, p in enumerate(PROMPTS):
        engine.scheduler.add_request(request(f"j{i}", p, {"json": SCHEMA}, max_tokens=120))
    out, finish, errors = run(engine)
    assert engine.scheduler.num_swap_outs > 0 and not errors
    for toks in out.values():
        _check_schema(text_of(tokenizer, toks))


def test_length_cap_gives_a_valid_prefix(tokenizer):
    engine = make_engine(tokenizer)
    engine.scheduler.add_request(request("short", PROMPTS[0], {"json": SCHEMA}, max_tokens=5))
    out, finish, _ = run(engine)
    assert finish["short"] == "length" and len(out["short"]) == 5
    assert '{"name": "'.startswith(text_of(tokenizer, out["short"]))  # a valid prefix


def test_jump_forward_appends_forced_tokens_and_stays_valid(tokenizer):
    manager = make_manager(tokenizer, jump_forward=True)
    engine = make_engine(tokenizer, manager=manager)
    for i, p in enumerate(PROMPTS):
        engine.scheduler.add_request(request(f"j{i}", p, {"json": SCHEMA}, max_tokens=200))
    out, finish, errors = run(engine)
    assert not errors and manager.num_forced_tokens > 0
    for toks in out.values():
        _check_schema(text_of(tokenizer, toks))


def test_loading_the_tokenizer_does_not_count_against_the_compile_timeout(tokenizer):
    import time

    from llmtower.structured_output.backend_xgrammar import XgrammarBackend
    from llmtower.structured_output.manager import (StructuredOutputManager,
                                                    StructuredOutputsConfig)

    def slow_factory():
        time.sleep(0.3)  # a slow first load (a big tokenizer on a busy machine)
        return XgrammarBackend(tokenizer, 512, [EOS])

    manager = StructuredOutputManager(StructuredOutputsConfig(compile_timeout_s=0.1),
                                      slow_factory)
    engine = make_engine(tokenizer, manager=manager)
    engine.scheduler.add_request(request("first", PROMPTS[0], {"choice": ["a", "b"]}))
    out, finish, errors = run(engine)
    assert not errors and finish == {"first": "stop"}
