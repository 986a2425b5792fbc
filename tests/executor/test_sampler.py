"""The sampler on hand-made logits: greedy, temperature, top-k/p, min-p, seeds, penalties,
min_tokens and logprobs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmtower.core.outputs import NewRequestData
from llmtower.core.sampling_params import SamplingParams
from llmtower.executor.input_batch import InputBatch
from llmtower.executor.sampler import Sampler

VOCAB = 8
EOS = 7
LOGITS = torch.tensor([1.0, 3.0, 2.5, 0.5, -1.0, 2.9, 0.0, 4.0])  # EOS (7) is the argmax


def make_batch(*params: SamplingParams, prompt=(3, 3, 4), outputs=()) -> tuple[InputBatch, np.ndarray]:
    batch = InputBatch(max_model_len=64, block_size=4, vocab_size=VOCAB, eos_token_ids=[EOS])
    rows = []
    for i, sp in enumerate(params):
        row = batch.add_request(NewRequestData(f"r{i}", list(prompt), sp, [0], 0))
        if outputs:
            batch.append_sampled(np.array([row]), np.array([outputs[0]]))
            for t in outputs[1:]:
                batch.append_sampled(np.array([row]), np.array([t]))
        rows.append(row)
    return batch, np.array(rows)


def sample(*params: SamplingParams, logits=LOGITS, sampler=None, **kw):
    batch, rows = make_batch(*params, **kw)
    tokens, lps = (sampler or Sampler(seed=0))(logits.repeat(len(params), 1), rows, batch)
    return tokens.tolist(), lps


def test_greedy_is_the_argmax():
    tokens, lps = sample(SamplingParams(temperature=0.0), SamplingParams(temperature=0.0))
    assert tokens == [7, 7] and lps is None


def test_temperature_sampling_follows_the_softmax():
    sp = SamplingParams(temperature=2.0)
    batch, rows = make_batch(*[sp] * 4000)
    tokens, _ = Sampler(seed=0)(LOGITS.repeat(4000, 1), rows, batch)
    freq = np.bincount(tokens, minlength=VOCAB) / 4000
    expected = torch.softmax(LOGITS / 2.0, -1).numpy()
    assert np.abs(freq - expected).max() < 0.03


def test_top_k_top_p_min_p_restrict_the_candidates():
    n = 300
    tokens, _ = sample(*[SamplingParams(temperature=5.0, top_k=2)] * n)
    assert set(tokens) == {7, 1}
    # softmax(LOGITS): 7 -> 0.43, 1 -> 0.16, 5 -> 0.14, ... top_p 0.5 keeps {7, 1}.
    tokens, _ = sample(*[SamplingParams(temperature=1.0, top_p=0.5)] * n)
    assert set(tokens) == {7, 1}
    # min_p 0.3: keep tokens with at least 0.3 * p(7) = 0.13 -> {7, 1, 5}.
    tokens, _ = sample(*[SamplingParams(temperature=1.0, min_p=0.3)] * n)
    assert set(tokens) == {7, 1, 5}
    tokens, _ = sample(*[SamplingParams(temperature=1.0, top_k=1)] * 20)
    assert set(tokens) == {7}


def test_seeded_request_does_not_depend_on_its_neighbours():
    seeded = SamplingParams(temperature=1.0, seed=42)
    s1, s2 = Sampler(seed=1), Sampler(seed=2)  # different shared generators
    batch1, rows1 = make_batch(seeded)
    batch2, rows2 = make_batch(SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.0))
    seq1 = [int(s1(LOGITS[None], rows1, batch1)[0][0]) for _ in range(30)]
    seq2 = [int(s2(LOGITS.repeat(3, 1), rows2, batch2)[0][1]) for _ in range(30)]
    assert seq1 == seq2
    assert len(set(seq1)) > 1  # it does sample, and its generator advances per token


def test_repetition_penalty_discourages_prompt_and_output_tokens():
    logits = torch.tensor([0.0, 2.0, 1.9, 0.0, 1.0, 0.0, 0.0, -5.0])
    tokens, _ = sample(SamplingParams(temperature=0.0), logits=logits, prompt=(1, 0))
    assert tokens == [1]
    # 2.0 / 1.5 = 1.33 < 1.9
    tokens, _ = sample(SamplingParams(temperature=0.0, repetition_penalty=1.5), logits=logits,
                       prompt=(1, 0))
    assert tokens == [2]
    # A negative logit is multiplied (-1.0 * 1.5 = -1.5 < -1.2), not divided.
    negative = torch.tensor([-1.0, -1.2, -3.0, -3.0, -3.0, -3.0, -3.0, -3.0])
    tokens, _ = sample(SamplingParams(temperature=0.0, repetition_penalty=1.5), logits=negative,
                       prompt=(0,))
    assert tokens == [1]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.tensor([0.0, 2.0, 1.5, 0.0, 0.0, 0.0, 0.0, -5.0])
    # Token 1 in the prompt only: no effect.
    tokens, _ = sample(SamplingParams(temperature=0.0, presence_penalty=1.0), logits=logits,
                       prompt=(1, 1))
    assert tokens == [1]
    # Token 1 generated once: 2.0 - 1.0 presence = 1.0 < 1.5.
    tokens, _ = sample(SamplingParams(temperature=0.0, presence_penalty=1.0), logits=logits,
                       outputs=(1,))
    assert tokens == [2]
    # Frequency: 2.0 - 0.2 * 2 = 1.6 > 1.5, but 2.0 - 0.2 * 3 = 1.4 < 1.5.
    tokens, _ = sample(SamplingParams(temperature=0.0, frequency_penalty=0.2), logits=logits,
                       outputs=(1, 1))
    assert tokens == [1]
    tokens, _ = sample(SamplingParams(temperature=0.0, frequency_penalty=0.2), logits=logits,
                       outputs=(1, 1, 1))
    assert tokens == [2]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    sp = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1], max_tokens=8)
    tokens, _ = sample(sp, outputs=(4,))  # 1 output so far: EOS (7) and stop token 1 masked
    assert tokens == [5]
    tokens, _ = sample(sp, outputs=(4, 4))  # 2 outputs: no mask
    assert tokens == [7]
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, max_tokens=8)
    tokens, _ = sample(ignore, outputs=(4,))
    assert tokens == [7]  # with ignore_eos, EOS is not a stop token, so it is not masked


def test_min_tokens_with_nothing_to_mask_keeps_the_greedy_fast_path(monkeypatch):
    """ignore_eos and no stop_token_ids: min_tokens masks nothing, so the row takes the one
    argmax of a plain greedy step (no per-row processing: vLLM's benchmarks set min_tokens)."""
    ignore = SamplingParams(temperature=0.0, min_tokens=4, ignore_eos=True, max_tokens=8)
    masked = SamplingParams(temperature=0.0, min_tokens=4, max_tokens=8)
    batch, rows = make_batch(ignore, masked, outputs=(4,))
    assert batch.needs_processing[rows].tolist() == [False, True]
    processed: list[int] = []
    real = Sampler._process
    monkeypatch.setattr(Sampler, "_process",
                        lambda self, lg, r, b: processed.append(len(r)) or real(self, lg, r, b))
    tokens, _ = sample(ignore, outputs=(4,))
    assert (tokens, processed) == ([7], [])
    tokens, _ = sample(ignore, masked, outputs=(4,))
    assert (tokens, processed) == ([7, 1], [2])  # EOS masked in the second row only


def test_min_tokens_masks_only_its_own_rows_beside_bias_and_plain_rows():
    masked = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1], max_tokens=8,
                            logprobs=1)
    biased = SamplingParams(temperature=0.0, min_tokens=3, logit_bias={2: 5.0}, max_tokens=8)
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    tokens, lps = sample(masked, biased, plain, masked, outputs=(4,))
    # masked: EOS and 1 at -inf -> 5; biased: 2 (2.5 + 5) beats all; plain: EOS.
    assert tokens == [5, 2, 7, 5]
    # The reported logprob is the raw distribution's, not the masked one's.
    assert lps is not None and lps[0] is not None
    assert lps[0].logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[5]))


def test_logprobs_of_the_raw_distribution():
    sp = SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0)
    tokens, lps = sample(sp, SamplingParams(temperature=0.0), prompt=(7,))
    raw = torch.log_softmax(LOGITS, -1)
    assert lps[1] is None
    e = lps[0]
    assert tokens[0] == e.token_id == 1  # the penalty moved the choice off 7...
    assert e.logprob == pytest.approx(raw[1].item())  # ...but logprobs are of the raw logits
    assert e.rank == 2
    assert [t for t, _ in e.top] == [7, 1, 5]
    assert [v for _, v in e.top] == pytest.approx(raw[[7, 1, 5]].tolist())


def test_logprobs_zero_gives_only_the_sampled_token():
    tokens, lps = sample(SamplingParams(temperature=0.0, logprobs=0))
    assert lps[0].top == [] and lps[0].rank == 1 and lps[0].token_id == 7


# ---------------------------------------------------------------- through the engine
def _run(core, reqs):
    """Run requests to the end; (outputs per request, finish reason per request)."""
    outs, finish = {}, {}
    for r in reqs:
        core.add_request(r)
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            outs.setdefault(o.request_id, []).append(o)
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
    return outs, finish


def test_engine_returns_logprobs_and_honours_min_tokens(tiny_llama_dir):
    from exactness_helpers import make_engine

    from llmtower.core.outputs import EngineCoreRequest

    prompt = [5, 77, 300, 12, 9, 450, 33]
    core = make_engine(tiny_llama_dir)
    outs, _ = _run(core, [EngineCoreRequest("lp", prompt, SamplingParams(
        temperature=0.0, logprobs=3, max_tokens=4, ignore_eos=True))])
    tokens = [t for o in outs["lp"] for t in o.new_token_ids]
    entries = [e for o in outs["lp"] for e in o.new_logprobs]
    assert [e[0] for e in entries] == tokens and len(tokens) == 4
    for token, logprob, rank, top in entries:
        assert rank == 1 and len(top) == 3 and top[0] == (token, logprob)
        assert top[0][1] >= top[1][1] >= top[2][1] and logprob < 0

    # Make the greedy first token the EOS: without min_tokens the request stops at once.
    eos = tokens[0]
    outs, finish = _run(core, [
        EngineCoreRequest("stop", prompt, SamplingParams(temperature=0.0, max_tokens=6), eos_token_id=eos),
        EngineCoreRequest("min", prompt, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3),
                          eos_token_id=eos)])
    assert [t for o in outs["stop"] for t in o.new_token_ids] == [eos] and finish["stop"] == "stop"
    got = [t for o in outs["min"] for t in o.new_token_ids]
    assert len(got) >= 3 and eos not in got[:3]


def test_logit_bias_steers_greedy_and_sampling_but_not_the_reported_logprobs():
    # +5 on token 2 makes it the argmax (2.5 + 5 > 4.0); -100 removes EOS from sampling.
    tokens, lps = sample(SamplingParams(temperature=0.0, logit_bias={2: 5.0}, logprobs=0),
                         SamplingParams(temperature=0.0))
    assert tokens == [2, 7]
    # Logprobs are the model's own distribution, before the bias (as vLLM reports them).
    assert lps[0].logprob == pytest.approx(torch.log_softmax(LOGITS, -1)[2].item())
    tokens, _ = sample(*[SamplingParams(temperature=1.0, logit_bias={7: -100.0})] * 300)
    assert 7 not in tokens
    # Ids outside the model's vocabulary are ignored by the runner (the server refuses them).
    tokens, _ = sample(SamplingParams(temperature=0.0, logit_bias={VOCAB + 3: 50.0}))
    assert tokens == [7]


def test_logit_bias_out_of_range_is_a_clear_error():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 150.0})


def test_greedy_argmax_is_torchs_on_ties_nan_and_infinities():
    """The greedy fast path takes numpy's argmax: the same token as torch's argmax (the first
    maximum, the first NaN, the first +inf; an all -inf row gives 0) on every row."""
    nan, inf = float("nan"), float("inf")
    rows = [[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 0.0], [1.0, nan, 5.0, nan],
            [-inf, -inf, -inf, -inf], [0.0, -0.0, 0.0, 1.0e-45], [-0.0, 0.0, -1.0, -2.0],
            [inf, 1.0, inf, 2.0], [-inf, nan, 0.0, inf], [2.0, 2.0, 2.0, 2.0]]
    gen = torch.Generator().manual_seed(0)
    big = torch.randint(-3, 4, (64, 49152), generator=gen).float()  # many ties in each row
    big[5, 1000] = nan
    for logits in (torch.tensor(rows), big, big[:1], big[:, :17]):
        batch, idx = make_batch(*[SamplingParams(temperature=0.0)] * logits.shape[0])
        tokens, lps = Sampler(seed=0)(logits, idx, batch)
        assert tokens.dtype == np.int64 and lps is None
        assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    # The processing path (logprobs asked) takes the same argmax after its work.
    batch, idx = make_batch(*[SamplingParams(temperature=0.0, logprobs=1)] * 9)
    tokens, lps = Sampler(seed=0)(torch.tensor(rows), idx, batch)
    assert tokens.tolist() == torch.tensor(rows).argmax(dim=-1).tolist()



def test_draw_tokens_never_picks_a_zero_probability_entry():
    """The inverse-CDF draw: entries with no chance (first, last, between) are never drawn,
    even at u = 0 and where u times the total rounds up to the total; the frequencies follow
    the probabilities."""
    from llmtower.executor.sampler import draw_tokens, pick_tokens
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]])
    tokens = draw_tokens(probs.repeat(4000, 1), [None] * 4000, torch.Generator().manual_seed(3))
    assert set(tokens.tolist()) == {1, 3}
    assert (tokens == 3).float().mean().item() == pytest.approx(0.75, abs=0.03)
    edges = torch.tensor([[0.0], [0.2499], [0.25], [1.0 - 2 ** -24], [1.0]])
    assert pick_tokens(probs.repeat(5, 1), edges).tolist() == [1, 1, 3, 3, 3]
