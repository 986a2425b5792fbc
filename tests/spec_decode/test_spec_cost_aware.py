"""Cost-aware draft lengths: the step cost model (fixed + per-row cost, fitted from timed steps),
the threshold it sets for a batch, and the pooled prior for requests without a history."""
from __future__ import annotations

import math

import pytest

from llmtower.spec_decode.adaptive import AdaptiveDraftLength
from llmtower.spec_decode.step_cost import PRIOR_FIXED_ROWS, StepCostModel


def test_cost_model_recovers_fixed_and_per_row_cost():
    m = StepCostModel()
    for i in range(200):
        rows = [1, 8, 16, 40, 9, 72][i % 6]
        m.observe(rows, 0.036 + 0.0016 * rows)  # SmolLM2 on one core, roughly
    assert m.fixed_rows() == pytest.approx(0.036 / 0.0016, rel=1e-6)
    # one stream: a draft row is nearly free; a batch of 8 needs a quarter; 64 needs most
    assert m.min_acceptance(1) == pytest.approx(1 / (1 + 22.5))
    assert m.min_acceptance(8) == pytest.approx(1 / (1 + 22.5 / 8))
    assert m.min_acceptance(64) > 0.7


def test_cost_model_keeps_the_prior_until_step_sizes_differ():
    m = StepCostModel()
    assert m.fixed_rows() == PRIOR_FIXED_ROWS
    for _ in range(50):
        m.observe(8, 0.05)  # every step the same size: fixed and per-row cost inseparable
    assert m.fixed_rows() == PRIOR_FIXED_ROWS
    m.observe(0, 0.05)
    m.observe(8, float("nan"))  # ignored, not poisoning the sums
    assert m.fixed_rows() == PRIOR_FIXED_ROWS


def test_cost_model_follows_a_change():
    m = StepCostModel()
    for i in range(300):
        rows = 1 + i % 20
        m.observe(rows, 0.040 + 0.001 * rows)
    before = m.fixed_rows()
    for i in range(300):  # rows became expensive (say, a bigger model's share of the cores)
        rows = 1 + i % 20
        m.observe(rows, 0.010 + 0.005 * rows)
    assert before == pytest.approx(40, rel=0.05)
    assert m.fixed_rows() == pytest.approx(2, rel=0.1)


def test_a_costlier_step_shortens_drafts_but_not_independent_ones():
    ad = AdaptiveDraftLength(max_k=8, min_acceptance=0.25)
    for rid in ("a", "s"):
        for _ in range(30):
            ad.observe(rid, 4, 2, independent=rid == "s")  # a ~ 2/3 per tried token
    k_cheap = ad.num_drafts("a")
    assert k_cheap == int(math.log(0.25) / math.log(2 / 3))  # 3
    ad.set_min_acceptance(0.6)  # a big batch: a position must be accepted 60% of the time
    assert ad.num_drafts("a") == 1
    assert ad.num_drafts("s", independent=True) == k_cheap  # its own history and threshold
    ad.set_min_acceptance(0.1)  # below the configured 0.25: the configured one holds
    assert ad.num_drafts("a") == k_cheap


def test_newcomers_start_from_the_pooled_acceptance():
    ad = AdaptiveDraftLength(max_k=8, min_acceptance=0.25)
    assert ad.num_drafts("new") == int(math.log(0.25) / math.log(0.8))  # the prior: 6
    for i in range(40):  # every draft of every request rejected
        ad.observe(f"old{i}", 4, 0)
    assert ad.num_drafts("new") == 1  # a probe, not a full-length draft
    # a seeded request ignores the pool (its draws must not depend on other requests)
    assert ad.num_drafts("seeded", independent=True) == 6
    for i in range(40):
        ad.observe(f"copy{i}", 8, 8)  # now everything is accepted
    assert ad.num_drafts("new2") == 8
    # a newcomer's own state starts at the pool's average: one rejection does not zero it
    ad.observe("new2", 8, 7)
    assert ad.num_drafts("new2") >= 4
