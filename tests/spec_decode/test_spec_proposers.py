"""The proposers on their own: n-gram prompt lookup, the suffix trees (own tokens and recent
outputs of other requests, bounded memory, match-length-driven draft length), and the
per-request adaptive draft length."""
from __future__ import annotations

import random

import numpy as np
import pytest

from llmtower.spec_decode.adaptive import AdaptiveDraftLength
from llmtower.spec_decode.config import SpeculativeConfig
from llmtower.spec_decode.ngram_proposer import NgramProposer
from llmtower.spec_decode.suffix_proposer import SuffixProposer
from llmtower.spec_decode.suffix_tree import SuffixTree


def a(*xs):
    return np.array(xs, dtype=np.int32)


# ---------------------------------------------------------------------------- ngram
def test_ngram_copies_what_followed_the_longest_most_recent_match():
    p = NgramProposer(1, 3)
    # "7 8 9" occurs twice before the end; the most recent occurrence is followed by 4 5.
    assert p.propose_one(a(7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 7, 8, 9), 2) == [4, 5]
    # The longer match wins over a more recent shorter one: "1 2 3" -> 40, "3" alone -> 50.
    assert p.propose_one(a(1, 2, 3, 40, 0, 3, 50, 1, 2, 3), 1) == [40]
    assert p.propose_one(a(1, 2, 3, 4), 3) == []  # nothing repeats
    assert p.propose_one(a(5, 6, 5, 6), 0) == []


def test_ngram_respects_min_length_and_k():
    p = NgramProposer(2, 4)
    assert p.propose_one(a(3, 9, 1, 3), 4) == []  # only a 1-token match
    assert p.propose_one(a(3, 4, 9, 8, 7, 6, 3, 4), 3) == [9, 8, 7]
    assert p.propose_one(a(1, 2, 1, 2, 1, 2), 5) == [1, 2]  # the continuation runs to the end


# ---------------------------------------------------------------------------- suffix tree
def test_suffix_tree_counts_and_removal_frees_every_node():
    t = SuffixTree(4)
    seq = [1, 2, 3, 1, 2, 4]
    t.insert(seq)
    assert t.count(t.find([1, 2])) == 2
    assert set(t.children(t.find([1, 2]))) == {3, 4}
    assert t.count(t.find([2, 3, 1, 2])) == 1
    assert t.find([1, 2, 3, 1, 2]) is None  # deeper than max_depth
    t.insert([1, 2, 3])
    t.remove(seq)
    assert t.count(t.find([1, 2])) == 1 and set(t.children(t.find([1, 2]))) == {3}
    t.remove([1, 2, 3])
    assert t.num_nodes == 1 and not t.children(t.root) and not t._edges


def test_suffix_proposer_drafts_from_the_requests_own_tokens():
    p = SuffixProposer(max_depth=16, max_spec_factor=2.0, min_token_prob=0.1)
    body = [11, 12, 13, 14, 15, 16, 17, 18]
    hist = a(*(body + [99] + body[:3]))
    (draft,) = p.propose(["r"], [hist], [4], [len(hist)])
    assert draft == [14, 15, 16, 17]


def test_suffix_proposer_drafts_from_recent_outputs_of_other_requests():
    """What makes suffix decoding beyond n-gram: a finished request's output is copied by a
    later request whose own tokens never contained it."""
    p = SuffixProposer(max_depth=16)
    ngram = NgramProposer(2, 5)
    prompt = [1, 2, 3]
    output = [40, 41, 42, 43, 44, 45, 46, 47]
    p.propose(["a"], [a(*(prompt + output))], [4], [len(prompt)])
    p.remove("a")
    hist = a(7, 8, 9, 40, 41, 42)
    assert ngram.propose_one(hist, 4) == []
    (draft,) = p.propose(["b"], [hist], [4], [3])
    assert draft == [43, 44, 45]  # a 3-token match earns max_spec_factor (1.0) * 3 tokens


def test_suffix_draft_length_follows_match_length():
    p = SuffixProposer(max_depth=32, max_spec_factor=0.5, min_token_prob=0.0)
    seq = list(range(100, 120))
    p.propose(["a"], [a(*seq)], [1], [0])
    p.remove("a")
    short = p.propose(["b"], [a(5, 100, 101)], [16], [1])[0]
    long = p.propose(["c"], [a(5, *range(100, 108))], [16], [1])[0]
    assert short == [102]  # a 2-token match earns 0.5 * 2 = 1 token
    assert long == list(range(108, 112))  # an 8-token match earns 4


def test_suffix_min_token_prob_stops_uncertain_drafts():
    p = SuffixProposer(max_depth=8, min_token_prob=0.6, max_spec_factor=4.0)
    # After "1 2", 3 followed twice and 4 once: p(3) = 2/3 >= 0.6; then after "1 2 3" the
    # continuation 5 (once) / 6 (once): 2/3 * 1/2 < 0.6 stops the draft.
    p.propose(["a"], [a(1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 4)], [1], [0])
    p.remove("a")
    assert p.propose(["b"], [a(9, 1, 2)], [8], [1])[0] == [3]


def test_suffix_global_tree_memory_is_bounded():
    rng = random.Random(0)
    p = SuffixProposer(max_depth=8, max_cached_requests=5, max_cached_tokens=10_000)
    sizes = []
    for i in range(40):
        toks = [rng.randrange(1000) for _ in range(60)]
        p.propose([str(i)], [a(*toks)], [2], [10])
        p.remove(str(i))
        sizes.append(p.global_tree.num_nodes)
    assert len(p._cached) == 5
    assert max(sizes[10:]) <= 5 * 50 * 8 + 1  # 5 outputs of 50 tokens, <= 8 nodes per token
    p2 = SuffixProposer(max_depth=8, max_cached_requests=100, max_cached_tokens=120)
    for i in range(10):
        p2.propose([str(i)], [a(*[rng.randrange(1000) for _ in range(60)])], [2], [10])
        p2.remove(str(i))
    assert p2._cached_tokens <= 120 and len(p2._cached) == 2


# ---------------------------------------------------------------------------- adaptive K
def test_adaptive_length_falls_to_zero_probes_and_recovers():
    ad = AdaptiveDraftLength(max_k=5, min_acceptance=0.25)
    assert ad.num_drafts("r") == 5
    steps = 0
    while (k := ad.num_drafts("r")) > 0:
        ad.observe("r", k, 0)  # every draft rejected
        steps += 1
    assert steps <= 5  # K fell to 0 within a few rejections
    ks = [ad.num_drafts("r") for _ in range(5)]
    # A one-token probe after a back-off of 4 steps, open until a verification tells.
    assert ks == [0, 0, 0, 1, 1]
    ad.observe("r", 1, 0)  # the probe failed: the back-off doubles
    ks = [ad.num_drafts("r") for _ in range(9)]
    assert ks == [0] * 8 + [1]
    for _ in range(8):
        k = ad.num_drafts("r") or 1
        ad.observe("r", k, k)  # now everything is accepted
    assert ad.num_drafts("r") == 5
    ad.remove("r")
    assert "r" not in ad._states


def test_adaptive_length_is_in_between_for_middling_acceptance():
    ad = AdaptiveDraftLength(max_k=8, min_acceptance=0.25)
    for _ in range(30):
        ad.observe("r", 4, 1)  # one of four accepted: a ~ 0.5 per tried token
    assert 1 <= ad.num_drafts("r") <= 3


def test_adaptive_off_always_drafts_k():
    ad = AdaptiveDraftLength(max_k=3, min_acceptance=0.25, enabled=False)
    for _ in range(10):
        ad.observe("r", 3, 0)
    assert ad.num_drafts("r") == 3


# ---------------------------------------------------------------------------- config
@pytest.mark.parametrize("text, message", [
    ('{"method": "medusa"}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_max"),
    ('{"method": "draft_model"}', "model"),
    ('{"method": "ngram", "k": 3}', "unknown key"),
    ('{"method": ngram}', "not valid JSON"),
    ('[1, 2]', "JSON object"),
])
def test_bad_speculative_config_says_what_to_change(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(text)


def test_speculative_config_flag_reaches_engine_args():
    from llmtower.engine.args import EngineArgs

    args = EngineArgs(speculative_config='{"method": "suffix", "num_speculative_tokens": 8}')
    assert args.speculative.method == "suffix" and args.speculative.num_speculative_tokens == 8
    assert EngineArgs().speculative is None
    with pytest.raises(ValueError, match="method"):
        EngineArgs(speculative_config='{"method": "eagle"}')
