"""Suffix decoding (Oliaro et al., "SuffixDecoding", 2024; Snowflake's Arctic Inference):
draft from suffix trees over the request's own tokens and over the outputs of recent requests.

Agentic and code-editing workloads repeat themselves across requests (the same tool calls,
the same file rewritten with small edits), which prompt lookup within one request misses.
Two indexes are consulted for each request:

- its own tree: every substring of its prompt and output so far, updated per token;
- one global tree: the outputs of the last ``max_cached_requests`` finished requests (and at
  most ``max_cached_tokens`` tokens), least recently finished evicted first, so memory is
  bounded by about ``max_cached_tokens * max_depth`` nodes.

In each tree the longest suffix of the request's tokens that occurred before with a
continuation is found, and the most frequent continuation is followed while its estimated
probability stays above ``min_token_prob``, for at most ``max_spec_factor * match length``
tokens: a long match earns a long draft, a short one a short draft (the adaptive length of
suffix decoding). The draft with the higher expected number of accepted tokens wins.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from llmtower.spec_decode.suffix_tree import SuffixTree


@dataclass
class _Request:
    num_prompt: int
    tokens: list[int] = field(default_factory=list)
    tree: SuffixTree | None = None
    active: list[int] = field(default_factory=list)  # nodes of its suffixes, longest first
    indexed: int = 0  # tokens[:indexed] are in the tree


class SuffixProposer:
    """Owns each running request's suffix tree and the global tree of recent outputs."""

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 max_cached_tokens: int = 32768) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_tree = SuffixTree(max_depth)
        self._cached: OrderedDict[int, list[int]] = OrderedDict()  # finished outputs, oldest first
        self._seq = itertools.count()
        self._cached_tokens = 0
        self._reqs: dict[str, _Request] = {}

    def propose(self, req_ids: list[str], histories: list[np.ndarray], num_drafts: list[int],
                num_prompts: list[int] | None = None) -> list[list[int]]:
        out = []
        for i, (rid, hist, k) in enumerate(zip(req_ids, histories, num_drafts)):
            num_prompt = num_prompts[i] if num_prompts is not None else len(hist) - 1
            st = self._update(rid, hist, num_prompt, index=True)
            out.append(self._propose_one(st, k))
        return out

    def track(self, req_ids: list[str], histories: list[np.ndarray],
              num_prompts: list[int]) -> None:
        """Record the new tokens of requests that are not drafting this step, so a finished
        request's whole output joins the global tree. Their own trees are brought up to date
        only when they draft again: a request that never does is never indexed."""
        for rid, hist, num_prompt in zip(req_ids, histories, num_prompts):
            self._update(rid, hist, num_prompt, index=False)

    def _update(self, rid: str, hist: np.ndarray, num_prompt: int, index: bool) -> _Request:
        st = self._reqs.get(rid)
        n = len(hist)
        if st is None or n < len(st.tokens):  # new (or rewritten: rebuild)
            st = self._reqs[rid] = _Request(num_prompt, tree=SuffixTree(self.max_depth))
        if n > len(st.tokens):
            st.tokens.extend(hist[len(st.tokens):].tolist())
        if index and st.indexed < len(st.tokens):
            tree = st.tree
            assert tree is not None
            active = st.active
            for t in st.tokens[st.indexed:]:
                active = tree.append(active, t)
            st.active = active
            st.indexed = len(st.tokens)
        return st

    def _propose_one(self, st: _Request, k: int) -> list[int]:
        ctx = st.tokens[-(self.max_depth - 1):]
        best: list[int] = []
        best_score = 0.0
        # Leave the trie room below the match for a k-token draft (its depth is bounded).
        max_len = min(max(1, self.max_depth - k), self.max_depth - 1)
        for tree in (st.tree, self.global_tree):
            if tree is None or not tree.has_children(tree.root):
                continue
            if tree is st.tree:
                # The request's active nodes are its suffixes in its own tree, longest first:
                # the first one with a continuation is the longest match, with no walk.
                node = next((a for a in st.active
                             if tree.depth(a) <= max_len and tree.has_children(a)), None)
                m = tree.depth(node) if node is not None else 0
            else:
                node, m = tree.longest_continued_match(ctx, max_len)
            if node is None:
                continue
            limit = min(k, int(self.max_spec_factor * m))
            if limit <= 0:
                continue
            draft, score = tree.speculate(node, limit, self.min_token_prob)
            if score > best_score:
                best, best_score = draft, score
        return best

    def remove(self, req_id: str) -> None:
        """The request ended: its output joins the global tree (evicting the oldest)."""
        st = self._reqs.pop(req_id, None)
        if st is None or self.max_cached_requests == 0:
            return
        output = st.tokens[st.num_prompt:][:self.max_cached_tokens]
        if not output:
            return
        self.global_tree.insert(output)
        self._cached[next(self._seq)] = output
        self._cached_tokens += len(output)
        while (len(self._cached) > self.max_cached_requests
               or self._cached_tokens > self.max_cached_tokens):
            _, old = self._cached.popitem(last=False)
            self.global_tree.remove(old)
            self._cached_tokens -= len(old)
