"""Speculative decoding metrics: vLLM's spec_decode counters (with per-position acceptance)
on /metrics, and each request's draft / accepted counts in its metrics."""
from __future__ import annotations

import re

from llmtower.metrics.prometheus import ServingMetrics
from spec_helpers import add_requests, copy_prompts, make_engine, run_all, spec_json


def _value(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exported")


def test_prometheus_counters_follow_the_engine(tiny_llama_dir):
    core = make_engine(tiny_llama_dir, spec_json("ngram", 4, prompt_lookup_min=1))
    add_requests(core, copy_prompts(3, 0), 30)
    metrics = ServingMetrics("tiny")
    half = False
    while core.has_unfinished_requests():
        core.step()
        if not half and core.scheduler.spec_stats.num_drafts > 3:
            metrics.record_scheduler_stats(core.get_stats())  # a snapshot mid-run
            half = True
    stats = core.get_stats()
    metrics.record_scheduler_stats(stats)
    text = metrics.render().decode()
    assert stats.spec_num_accepted_tokens > 0
    assert _value(text, "vllm:spec_decode_num_drafts_total") == stats.spec_num_drafts
    assert _value(text, "vllm:spec_decode_num_draft_tokens_total") == stats.spec_num_draft_tokens
    assert (_value(text, "vllm:spec_decode_num_accepted_tokens_total")
            == stats.spec_num_accepted_tokens)
    per_pos = [_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=p)
               for p in range(len(stats.spec_num_accepted_tokens_per_pos))]
    assert per_pos == stats.spec_num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.spec_num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)  # position j needs all before it
    assert re.search(r'vllm:spec_decode_num_drafts_total\{engine="0",model_name="tiny"\}', text)


def test_per_request_accepted_counts(tiny_llama_dir, tiny_tokenizer_dir):
    from llmtower.core.sampling_params import SamplingParams
    from llmtower.engine.llm import LLM
    from llmtower.models.tokenizer import load_tokenizer

    core = make_engine(tiny_llama_dir, spec_json("ngram", 4, prompt_lookup_min=1))
    llm = LLM.from_engine_core(core, load_tokenizer(tiny_tokenizer_dir), [2])
    outs = llm.generate(copy_prompts(3, 0), SamplingParams(temperature=0, max_tokens=30,
                                                            ignore_eos=True), use_tqdm=False)
    drafted = [o.metrics.spec_num_draft_tokens for o in outs]
    accepted = [o.metrics.spec_num_accepted_tokens for o in outs]
    assert sum(accepted) == core.scheduler.spec_stats.num_accepted_tokens
    assert sum(drafted) == core.scheduler.spec_stats.num_draft_tokens
    assert all(0 <= a <= d for a, d in zip(accepted, drafted)) and sum(accepted) > 0
    # Without speculation the counts are zero.
    core2 = make_engine(tiny_llama_dir)
    add_requests(core2, copy_prompts(1, 0), 5)
    run_all(core2)
    assert core2.get_stats().spec_num_draft_tokens == 0
