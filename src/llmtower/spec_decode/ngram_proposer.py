"""N-gram (prompt lookup) drafting: find the last n tokens earlier in the request's own
prompt + output and propose what followed them there."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Owns the n-gram lengths; stateless across steps (the history is the request's tokens).

    The longest suffix of ``prompt_lookup_min``..``prompt_lookup_max`` tokens that occurred
    before wins; among equally long matches the most recent one, whose continuation is the
    likeliest to repeat in an edit or a rewrite. Cost: one vectorized scan of the history for
    the shortest n-gram (and none of the longer ones when it does not occur, the common case
    when there is nothing to copy), then a narrowing of its few matches.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_one(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` draft tokens continuing ``tokens`` (1-D int array); [] if no match."""
        n_min = self.min_n
        size = len(tokens)
        if k <= 0 or size <= n_min:
            return []
        pattern = tokens[size - n_min:]
        # Windows that start at i <= size - 1 - n_min, so a continuation token exists.
        windows = sliding_window_view(tokens[:size - 1], n_min)
        cand = np.flatnonzero((windows == pattern).all(axis=1))
        if cand.size == 0:
            return []
        best = int(cand[-1])
        # Lengthen the match backwards, one token at a time, while candidates survive.
        for extra in range(1, self.max_n - n_min + 1):
            ref = size - n_min - extra
            if ref < 0:
                break
            cand = cand[cand >= extra]
            cand = cand[tokens[cand - extra] == tokens[ref]]
            if cand.size == 0:
                break
            best = int(cand[-1])
        start = best + n_min
        return tokens[start:start + k].tolist()

    def propose(self, req_ids: list[str], histories: list[np.ndarray],  # noqa: ARG002
                num_drafts: list[int], num_prompts: list[int] | None = None,  # noqa: ARG002
                ) -> list[list[int]]:
        return [self.propose_one(h, k) for h, k in zip(histories, num_drafts)]

    def remove(self, req_id: str) -> None:
        """Nothing is kept per request."""
