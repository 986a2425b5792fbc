"""The offline LLM's scheduling controls (issue 17): set_priority on a request in flight and
tenant= for --policy fair, over the model-free fake executor."""
from __future__ import annotations

import pytest

from engine_helpers import make_fake_engine_core
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.llm import LLM


def test_set_priority_reaches_the_running_request_and_refuses_finished_ones(tokenizer):
    llm = LLM.from_engine_core(make_fake_engine_core(len(tokenizer), policy="priority"), tokenizer)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    seen = None
    for out in llm.stream("hello there", sp, priority=4):
        if seen is None:
            seen = out.request_id
            llm.set_priority(seen, -1)
            (req,) = llm.engine_core.scheduler.requests.values()
            assert req.priority == -1
    with pytest.raises(KeyError, match="not in flight"):
        llm.set_priority(seen, 0)
    with pytest.raises(KeyError):
        llm.set_priority("never-sent", 0)


def test_set_priority_needs_the_priority_policy(tokenizer):
    llm = LLM.from_engine_core(make_fake_engine_core(len(tokenizer)), tokenizer)
    it = llm.stream("hello", SamplingParams(max_tokens=5, ignore_eos=True))
    out = next(it)
    with pytest.raises(ValueError, match="--policy priority"):
        llm.set_priority(out.request_id, 1)
    it.close()


def test_tenant_reaches_the_fair_scheduler(tokenizer):
    core = make_fake_engine_core(len(tokenizer), policy="fair")
    llm = LLM.from_engine_core(core, tokenizer)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.generate(["one", "two"], sp, use_tqdm=False, tenant="acme")
    llm.generate(["three"], sp, use_tqdm=False, tenant=["zeta"])
    stats = core.get_stats().tenants
    assert set(stats) == {"acme", "zeta"}
    assert stats["acme"]["num_admitted"] == 2 and stats["zeta"]["num_admitted"] == 1
    with pytest.raises(ValueError, match="tenant has 2 entries"):
        llm.generate(["x"], sp, use_tqdm=False, tenant=["a", "b"])
