"""The flat suffix trie against a brute-force count of substrings, through inserts, removals
(which free nodes and reuse their ids) and drafting."""
from __future__ import annotations

import random
from collections import Counter

from llmtower.spec_decode.suffix_tree import SuffixTree


def _substrings(seqs: list[list[int]], depth: int) -> Counter:
    c: Counter = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                c[tuple(s[i:j])] += 1
    return c


def test_counts_children_and_node_reuse_match_brute_force():
    rng = random.Random(7)
    depth = 5
    t = SuffixTree(depth)
    live: list[list[int]] = []
    for step in range(60):
        if live and rng.random() < 0.4:
            t.remove(live.pop(rng.randrange(len(live))))
        else:
            seq = [rng.randrange(6) for _ in range(rng.randint(1, 25))]
            t.insert(seq)
            live.append(seq)
        want = _substrings(live, depth)
        assert t.num_nodes == 1 + len(want)
        for sub, n in want.items():
            node = t.find(sub)
            assert node is not None and t.count(node) == n, (step, sub)
            kids = {s[-1] for s in want if len(s) == len(sub) + 1 and s[:-1] == sub}
            assert set(t.children(node)) == kids
    for seq in live:
        t.remove(seq)
    assert t.num_nodes == 1 and not t._edges


def test_speculate_follows_the_most_frequent_continuation():
    t = SuffixTree(8)
    for seq in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6]):
        t.insert(seq)
    node = t.find([1, 2])
    draft, score = t.speculate(node, 4, 0.1)
    assert draft == [3, 4]
    assert score == 2 / 3 + 2 / 3
    assert t.speculate(node, 4, 0.7) == ([], 0.0)  # 2/3 < 0.7: nothing worth drafting
