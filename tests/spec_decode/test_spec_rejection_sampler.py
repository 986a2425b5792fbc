"""The rejection sampler keeps the target distribution exactly (chi-square over many draws),
for point-mass drafts (n-gram, suffix) and for drafts with their own distribution (draft
model); greedy keeps the longest matching prefix plus one; seeded draws are reproducible."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmtower.core.outputs import NewRequestData
from llmtower.core.sampling_params import SamplingParams
from llmtower.executor.input_batch import InputBatch
from llmtower.executor.rejection_sampler import RejectionSampler

V = 6  # a small vocabulary: every category gets many draws


def chi2_pvalue(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Goodness of fit (categories with expected probability 0 must not be observed)."""
    assert observed[expected_probs == 0].sum() == 0, "a token with probability 0 was drawn"
    keep = expected_probs > 0
    n = observed.sum()
    exp = expected_probs[keep] * n
    stat = float(((observed[keep] - exp) ** 2 / exp).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _batch(sp: SamplingParams, n_rows: int = 1) -> InputBatch:
    batch = InputBatch(64, 4, V, [0])
    for i in range(n_rows):
        batch.add_request(NewRequestData(str(i), [1, 2, 3], sp, [0], 0))
    return batch


def _draws(logits: torch.Tensor, draft: list[int], q: torch.Tensor | None, n: int,
           sp: SamplingParams) -> list[list[int]]:
    """n verifications; with ``q`` the draft tokens are drawn from q each time (as a draft
    model would), else ``draft`` is the fixed point-mass draft."""
    batch = _batch(sp)
    gen = torch.Generator()
    gen.manual_seed(1234)
    draft_gen = torch.Generator()
    draft_gen.manual_seed(99)
    rs = RejectionSampler(gen)
    rows = np.array([0])
    offsets = np.array([0])
    outs = []
    for _ in range(n):
        d = draft if q is None else torch.multinomial(q, 1, generator=draft_gen)[:, 0].tolist()
        outs.append(rs(logits, offsets, [d], rows, batch, None if q is None else [q])[0])
    return outs


def _target(logits: torch.Tensor, temperature: float) -> np.ndarray:
    return torch.softmax(logits / temperature, dim=-1).double().numpy()


@pytest.mark.parametrize("with_q", [False, True], ids=["point_mass_draft", "draft_distribution"])
def test_emitted_tokens_follow_the_target_distribution(with_q):
    torch.manual_seed(0)
    k = 2
    logits = torch.randn(k + 1, V) * 1.5
    temperature = 0.8
    p = _target(logits, temperature)
    q = None
    draft = [int(np.argsort(p[0])[-2]), int(np.argmax(p[1]))]  # a likely, not certain, draft
    if with_q:
        q = torch.softmax(torch.randn(k, V) + torch.from_numpy(np.log(p[:k])).float(), dim=-1)
    n = 6000
    outs = _draws(logits, draft, q, n, SamplingParams(temperature=temperature))
    first = np.bincount([o[0] for o in outs], minlength=V)
    assert chi2_pvalue(first, p[0]) > 1e-3
    # Given that the first draft was accepted, the next token follows p[1].
    second = np.bincount([o[1] for o in outs if len(o) > 1], minlength=V)
    assert second.sum() > 500
    assert chi2_pvalue(second, p[1]) > 1e-3
    # Given the first two drafts were accepted, the bonus token follows p[2].
    third = np.bincount([o[2] for o in outs if len(o) > 2], minlength=V)
    assert third.sum() > 200
    assert chi2_pvalue(third, p[2]) > 1e-3
    # Drafts are accepted sometimes, and rejected sometimes.
    assert 0 < sum(len(o) > 1 for o in outs) < n


def test_a_wrong_sampler_is_caught():
    """The test statistic has power: accepting drafts with probability 1 is detected."""
    torch.manual_seed(0)
    p = _target(torch.randn(V) * 1.5, 1.0)
    biased = p.copy()
    biased[np.argsort(p)[-2]] += 0.1
    biased /= biased.sum()
    rng = np.random.default_rng(0)
    observed = np.bincount(rng.choice(V, size=6000, p=biased), minlength=V)
    assert chi2_pvalue(observed, p) < 1e-3


def test_top_k_is_respected_and_draft_outside_it_is_always_rejected():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, -2.0]] * 2)
    outs = _draws(logits, [5], None, 2000, SamplingParams(temperature=1.0, top_k=3))
    first = np.bincount([o[0] for o in outs], minlength=V)
    assert first[3:].sum() == 0  # top-k = 3 and the draft (5) is outside it
    assert all(len(o) == 1 for o in outs)
    p = torch.softmax(logits[0, :3], -1).double().numpy()
    assert chi2_pvalue(first[:3], p) > 1e-3


def test_greedy_keeps_longest_matching_prefix_plus_one():
    logits = torch.full((4, V), -5.0)
    for j, t in enumerate([4, 1, 3, 2]):
        logits[j, t] = 5.0
    batch = _batch(SamplingParams(temperature=0.0))
    rs = RejectionSampler(torch.Generator())
    run = lambda d: rs(logits, np.array([0]), [d], np.array([0]), batch)[0]  # noqa: E731
    assert run([4, 1, 3]) == [4, 1, 3, 2]  # all accepted + bonus
    assert run([4, 1, 5]) == [4, 1, 3]  # third rejected: the target's token instead
    assert run([0, 1, 3]) == [4]  # first rejected


def test_seeded_requests_are_reproducible_and_independent_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    sp = SamplingParams(temperature=1.0, seed=7)

    def draw(n_rows: int, row: int) -> list[list[int]]:
        batch = _batch(sp, n_rows)
        rs = RejectionSampler(torch.Generator())
        big = logits.repeat(n_rows, 1)
        offsets = np.arange(n_rows) * 3
        rows = np.arange(n_rows)
        return [rs(big, offsets, [[1, 2]] * n_rows, rows, batch)[row] for _ in range(50)]

    alone = draw(1, 0)
    assert draw(1, 0) == alone
    assert draw(3, 2) == alone  # its own generator: the batch around it does not matter
