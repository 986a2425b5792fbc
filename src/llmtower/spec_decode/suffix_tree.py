"""A depth-limited suffix trie with occurrence counts: the index behind suffix decoding.

Every substring of at most ``max_depth`` tokens of the inserted sequences is a path from the
root; a node's ``count`` is how many times its substring occurred. Appending one token to a
sequence costs O(max_depth): the sequence keeps the nodes of its current suffixes ("active"),
each steps down by the new token, and a new length-1 suffix starts at the root. Removing a
sequence (to bound memory) walks the same paths and decrements, dropping nodes that reach 0.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while trie nodes are made. A new token makes up
    to ``max_depth`` nodes and dicts, so indexing a few hundred tokens triggers dozens of
    collections, some of them full ones that walk every object of the process (0.2 s in
    the middle of a step, measured). Trie nodes point only down to their children: they never
    form a cycle and refcounting frees them, so those collections find nothing here."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class SuffixNode:
    """One substring: its occurrence count and the tokens that followed it."""

    __slots__ = ("children", "count", "depth")

    def __init__(self, depth: int) -> None:
        self.children: dict[int, SuffixNode] | None = None  # lazily: most nodes are leaves
        self.count = 0
        self.depth = depth


class SuffixTree:
    """Owns the trie of every substring (up to ``max_depth`` tokens) of its sequences."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = SuffixNode(0)
        self.num_nodes = 1

    def append(self, active: list[SuffixNode], tok: int) -> list[SuffixNode]:
        """Extend a sequence whose current suffixes end at ``active`` by ``tok``; returns the
        new active nodes (longest suffix first)."""
        # The hottest loop of suffix decoding (max_depth dict updates per token of every
        # request): _child inlined, the root handled as one more parent.
        out: list[SuffixNode] = []
        add = out.append
        max_depth = self.max_depth
        created = 0
        for node in (*active, self.root):
            depth = node.depth
            if depth >= max_depth:
                continue
            children = node.children
            if children is None:
                children = node.children = {}
            child = children.get(tok)
            if child is None:
                child = children[tok] = SuffixNode(depth + 1)
                created += 1
            child.count += 1
            add(child)
        self.num_nodes += created
        return out

    def insert(self, tokens: Sequence[int]) -> None:
        active: list[SuffixNode] = []
        for t in tokens:
            active = self.append(active, t)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``insert(tokens)``."""
        d = self.max_depth
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i:i + d]:
                children = node.children
                child = children.get(t) if children else None
                if child is None:
                    break  # already gone (removed through a shorter path)
                child.count -= 1
                if child.count <= 0:
                    del children[t]  # type: ignore[union-attr]
                    self.num_nodes -= _size(child)
                    break
                node = child

    def _child(self, node: SuffixNode, tok: int) -> SuffixNode:
        children = node.children
        if children is None:
            children = node.children = {}
        child = children.get(tok)
        if child is None:
            child = children[tok] = SuffixNode(node.depth + 1)
            self.num_nodes += 1
        child.count += 1
        return child

    def find(self, context: Sequence[int]) -> SuffixNode | None:
        """The node of ``context`` (a path from the root), or None."""
        node = self.root
        for t in context:
            children = node.children
            node = children.get(t) if children else None  # type: ignore[assignment]
            if node is None:
                return None
        return node

    def longest_continued_match(self, context: Sequence[int], max_len: int
                                ) -> tuple[SuffixNode | None, int]:
        """The longest suffix of ``context``, of at most ``max_len`` tokens, that occurred
        followed by some token: (its node, its length). Such suffixes are closed under shortening (an earlier occurrence of the
        last m tokens contains one of the last m - 1, with the same next token), so a binary
        search over the length finds it in O(log depth) walks."""
        lo, hi = 0, min(len(context), max_len, self.max_depth - 1)
        best: SuffixNode | None = None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self.find(context[len(context) - mid:])
            if node is not None and node.children:
                lo, best = mid, node
            else:
                hi = mid - 1
        return best, lo

    def speculate(self, node: SuffixNode, max_tokens: int, min_prob: float
                  ) -> tuple[list[int], float]:
        """Follow the most frequent continuation from ``node`` while the estimated chance of
        the whole draft so far stays >= ``min_prob``. Returns (draft, score), the score being
        the expected number of accepted tokens (sum of the drafts' path probabilities)."""
        draft: list[int] = []
        prob = 1.0
        score = 0.0
        while len(draft) < max_tokens and node.children:
            total = sum(c.count for c in node.children.values())
            tok, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / total
            if prob < min_prob:
                break
            draft.append(tok)
            score += prob
            node = child
        return draft, score


def _size(node: SuffixNode) -> int:
    n, stack = 0, [node]
    while stack:
        x = stack.pop()
        n += 1
        if x.children:
            stack.extend(x.children.values())
    return n
