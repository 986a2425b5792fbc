"""A depth-limited suffix trie with occurrence counts: the index behind suffix decoding.

Every substring of at most ``max_depth`` tokens of the inserted sequences is a path from the
root; a node's count is how many times its substring occurred. Appending one token to a
sequence costs O(max_depth): the sequence keeps the nodes of its current suffixes ("active"),
each steps down by the new token, and a new length-1 suffix starts at the root. Removing a
sequence (to bound memory) walks the same paths and decrements, dropping nodes that reach 0.

Nodes are integer ids into flat lists, and the edges one dict of int keys to int ids: a token
makes up to ``max_depth`` nodes, and as Python objects (one per node, plus a dict of its
children) they made the cyclic garbage collector run dozens of times per few hundred tokens,
some of them full collections walking every object of the process (0.1-0.2 s in the middle
of a step, measured). Ints and a dict holding only ints are not tracked by the collector.
"""
from __future__ import annotations

from collections.abc import Sequence

ROOT = 0
NONE = -1
_SHIFT = 32  # edge key: parent id << 32 | token (token ids are < 2**32)


class SuffixTree:
    """Owns the trie of every substring (up to ``max_depth`` tokens) of its sequences: per
    node its count, depth, first child and next sibling (children as a linked list, read when
    drafting and removing), and the edges (parent, token) -> child."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = ROOT
        self._edges: dict[int, int] = {}
        self._count: list[int] = [0]
        self._depth: list[int] = [0]
        self._token: list[int] = [NONE]
        self._first: list[int] = [NONE]
        self._next: list[int] = [NONE]
        self._free: list[int] = []
        self.num_nodes = 1

    # ------------------------------------------------------------------ reading
    def depth(self, node: int) -> int:
        return self._depth[node]

    def count(self, node: int) -> int:
        return self._count[node]

    def has_children(self, node: int) -> bool:
        return self._first[node] != NONE

    def children(self, node: int) -> dict[int, int]:
        """Token -> child node."""
        out = {}
        c = self._first[node]
        while c != NONE:
            out[self._token[c]] = c
            c = self._next[c]
        return out

    # ------------------------------------------------------------------ writing
    def append(self, active: list[int], tok: int) -> list[int]:
        """Extend a sequence whose current suffixes end at ``active`` by ``tok``; returns the
        new active nodes (longest suffix first). The hottest loop of suffix decoding."""
        out: list[int] = []
        add = out.append
        edges, count, depth = self._edges, self._count, self._depth
        max_depth = self.max_depth
        for node in (*active, ROOT):
            d = depth[node]
            if d >= max_depth:
                continue
            key = (node << _SHIFT) | tok
            child = edges.get(key)
            if child is None:
                child = edges[key] = self._new_node(node, tok, d + 1)
            count[child] += 1
            add(child)
        return out

    def _new_node(self, parent: int, tok: int, depth: int) -> int:
        if self._free:
            n = self._free.pop()
            self._count[n], self._depth[n], self._token[n] = 0, depth, tok
            self._first[n] = NONE
        else:
            n = len(self._count)
            self._count.append(0)
            self._depth.append(depth)
            self._token.append(tok)
            self._first.append(NONE)
            self._next.append(NONE)
        self._next[n] = self._first[parent]
        self._first[parent] = n
        self.num_nodes += 1
        return n

    def insert(self, tokens: Sequence[int]) -> None:
        active: list[int] = []
        for t in tokens:
            active = self.append(active, t)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``insert(tokens)``."""
        d = self.max_depth
        edges, count = self._edges, self._count
        for i in range(len(tokens)):
            node = ROOT
            for t in tokens[i:i + d]:
                child = edges.get((node << _SHIFT) | t)
                if child is None:
                    break  # already gone (removed through a shorter path)
                count[child] -= 1
                if count[child] <= 0:
                    self._drop(node, child)
                    break
                node = child

    def _drop(self, parent: int, node: int) -> None:
        """Unlink ``node`` from ``parent`` and free its whole subtree."""
        first, nxt, token = self._first, self._next, self._token
        if first[parent] == node:
            first[parent] = nxt[node]
        else:
            c = first[parent]
            while nxt[c] != node:
                c = nxt[c]
            nxt[c] = nxt[node]
        del self._edges[(parent << _SHIFT) | token[node]]
        stack = [node]
        while stack:
            x = stack.pop()
            c = first[x]
            while c != NONE:
                del self._edges[(x << _SHIFT) | token[c]]
                stack.append(c)
                c = nxt[c]
            self._free.append(x)
            self.num_nodes -= 1

    # ------------------------------------------------------------------ matching
    def find(self, context: Sequence[int]) -> int | None:
        """The node of ``context`` (a path from the root), or None."""
        node = ROOT
        edges = self._edges
        for t in context:
            child = edges.get((node << _SHIFT) | t)
            if child is None:
                return None
            node = child
        return node

    def longest_continued_match(self, context: Sequence[int], max_len: int
                                ) -> tuple[int | None, int]:
        """The longest suffix of ``context``, of at most ``max_len`` tokens, that occurred
        followed by some token: (its node, its length). Such suffixes are closed under
        shortening (an earlier occurrence of the last m tokens contains one of the last m - 1,
        with the same next token), so a binary search over the length finds it in
        O(log depth) walks."""
        lo, hi = 0, min(len(context), max_len, self.max_depth - 1)
        best: int | None = None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self.find(context[len(context) - mid:])
            if node is not None and self._first[node] != NONE:
                lo, best = mid, node
            else:
                hi = mid - 1
        return best, lo

    def speculate(self, node: int, max_tokens: int, min_prob: float
                  ) -> tuple[list[int], float]:
        """Follow the most frequent continuation from ``node`` while the estimated chance of
        the whole draft so far stays >= ``min_prob``. Returns (draft, score), the score being
        the expected number of accepted tokens (sum of the drafts' path probabilities)."""
        first, nxt, count = self._first, self._next, self._count
        draft: list[int] = []
        prob = 1.0
        score = 0.0
        while len(draft) < max_tokens and first[node] != NONE:
            total = 0
            best, best_count = NONE, 0
            c = first[node]
            while c != NONE:
                n = count[c]
                total += n
                if n >= best_count:  # ties: the oldest child (the list runs newest first)
                    best, best_count = c, n
                c = nxt[c]
            prob *= best_count / total
            if prob < min_prob:
                break
            draft.append(self._token[best])
            score += prob
            node = best
        return draft, score
