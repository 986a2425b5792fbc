"""Sampling with speculation through the whole engine: the tokens a request emits follow the
target model's distribution (chi-square against probabilities computed with transformers),
and seeded requests are reproducible."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from spec_helpers import add_requests, make_engine, run_all, spec_json
from test_spec_rejection_sampler import chi2_pvalue

PROMPT = [5, 77, 300, 12, 9, 41, 230, 18]
TOP_K = 3


class OracleProposer:
    """Drafts the target's most likely next token (known in advance): often, not always,
    accepted under sampling."""

    def __init__(self, best_next: dict[tuple[int, ...], int]) -> None:
        self.best_next = best_next

    def propose(self, req_ids, histories, num_drafts, num_prompts=None):  # noqa: ARG002
        out = []
        for h in histories:
            t = self.best_next.get(tuple(h.tolist()))
            out.append([t] if t is not None else [])
        return out

    def remove(self, req_id):
        pass


def _exact_joint(model_dir, temperature: float):
    """P(t1, t2, t3) under temperature + top-k, and each context's most likely next token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def dist(ctx: list[int]) -> dict[int, float]:
        with torch.inference_mode():
            logits = model(torch.tensor([ctx])).logits[0, -1] / temperature
        top = torch.topk(logits, TOP_K)
        probs = torch.softmax(top.values.double(), -1)
        return dict(zip(top.indices.tolist(), probs.tolist()))

    joint: dict[tuple[int, int, int], float] = {}
    best: dict[tuple[int, ...], int] = {}
    d1 = dist(PROMPT)
    for t1, p1 in d1.items():
        d2 = dist(PROMPT + [t1])
        best[tuple(PROMPT + [t1])] = max(d2, key=d2.get)
        for t2, p2 in d2.items():
            d3 = dist(PROMPT + [t1, t2])
            best[tuple(PROMPT + [t1, t2])] = max(d3, key=d3.get)
            for t3, p3 in d3.items():
                joint[(t1, t2, t3)] = p1 * p2 * p3
    return joint, best


@pytest.mark.parametrize("drafter", ["oracle", "draft_self", "draft_random"])
def test_emitted_tokens_follow_the_target_distribution(tiny_llama_dir, tmp_path_factory,
                                                       tiny_tokenizer_dir, drafter):
    """oracle: point-mass drafts, often accepted; draft_self: the target as draft model
    (q = p, every draft accepted); draft_random: another random model (q far from p, drafts
    mostly rejected: the residual distribution max(0, p - q) carries the test)."""
    temperature = 0.7
    joint, best = _exact_joint(tiny_llama_dir, temperature)
    kw = dict(max_num_seqs=256, num_gpu_blocks=2048)
    if drafter == "oracle":
        core = make_engine(tiny_llama_dir, spec_json("ngram", 2, adaptive=False), **kw)
        core.executor.runner.spec_decode.proposer = OracleProposer(best)
    else:
        from tests.fixtures.tiny_models import make_tiny_model_dir
        draft = tiny_llama_dir if drafter == "draft_self" else make_tiny_model_dir(
            tmp_path_factory, "llama", tokenizer_dir=tiny_tokenizer_dir, hidden_size=32,
            num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=3,
            initializer_range=0.5)
        core = make_engine(tiny_llama_dir, spec_json("draft_model", 2, model=str(draft),
                                                     adaptive=False), **kw)
    n = 3000 if drafter == "oracle" else 2000
    for i in range(0, n, 500):
        add_requests(core, [PROMPT] * 500, 3, first_id=i, temperature=temperature, top_k=TOP_K)
    out = run_all(core)
    cells = sorted(joint)
    index = {c: j for j, c in enumerate(cells)}
    observed = np.zeros(len(cells))
    for toks in out.values():
        observed[index[tuple(toks)]] += 1  # a KeyError would be a token outside top-k
    expected = np.array([joint[c] for c in cells])
    assert chi2_pvalue(observed, expected) > 1e-3
    stats = core.scheduler.spec_stats
    assert stats.num_drafts > n // 2  # most requests verified a draft
    if drafter == "draft_self":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    if drafter == "oracle":
        assert stats.num_accepted_tokens > 0


def test_seeded_requests_reproducible_with_speculation(tiny_qwen2_dir):
    prompts = [PROMPT, PROMPT[:5] * 3, [7, 8, 9, 7, 8, 9, 7, 8]]

    def run(extra: int) -> dict[str, list[int]]:
        core = make_engine(tiny_qwen2_dir, spec_json("ngram", 4, prompt_lookup_min=1))
        for i, p in enumerate(prompts):
            add_requests(core, [p], 24, first_id=i, temperature=0.9, seed=100 + i)
        # Unseeded neighbours change the batch, not the seeded requests' tokens.
        add_requests(core, [PROMPT] * extra, 24, first_id=100, temperature=1.0)
        got = run_all(core)
        return {k: v for k, v in got.items() if int(k) < 100}

    first = run(0)
    assert run(0) == first
    assert run(5) == first
    assert all(len(v) == 24 for v in first.values())


def test_sampling_every_combination_of_settings_runs(tiny_llama_dir):
    """top-p, min-p, top-k and greedy requests in one batch, all with drafts."""
    core = make_engine(tiny_llama_dir, spec_json("ngram", 3, prompt_lookup_min=1))
    settings = [dict(temperature=0.0), dict(temperature=1.0, top_p=0.5),
                dict(temperature=1.0, min_p=0.2), dict(temperature=0.5, top_k=2)]
    for i, (sp, p) in enumerate(itertools.product(settings, [PROMPT, PROMPT[:4] * 4])):
        add_requests(core, [p], 20, first_id=i, **sp)
    out = run_all(core)
    assert len(out) == 8 and all(len(v) == 20 for v in out.values())
    assert core.scheduler.spec_stats.num_draft_tokens > 0
