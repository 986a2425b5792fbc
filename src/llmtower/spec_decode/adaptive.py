"""Per-request adaptive draft length: draft fewer tokens (down to none) while they are rejected.

A draft position j (1-based) is accepted only if the j-1 before it were, so with a per-token
acceptance chance a it is accepted with probability a**j. A position costs one more token in
the forward pass whether accepted or not, so it is worth drafting while a**j stays above
``min_acceptance`` (the cost of one verified position relative to what an accepted token
saves). ``a`` is a decayed average over the request's own verifications, counting only the
positions that were actually tried (those up to and including the first rejection).

At K = 0 the request probes with a single draft token after a back-off that doubles with each
failed probe (4, 8, ... 64 steps), so a request that starts copying later still gets drafts,
and one with nothing to copy pays for one extra position every 64 steps at most.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DECAY = 0.8
PRIOR_ACCEPTED, PRIOR_TRIED = 2.0, 2.5  # start optimistic (a = 0.8): drafts must prove useless
MIN_BACKOFF, MAX_BACKOFF = 4, 64


@dataclass
class _State:
    accepted: float = PRIOR_ACCEPTED
    tried: float = PRIOR_TRIED
    backoff: int = MIN_BACKOFF
    wait: int = 0  # steps left before the next probe while K = 0


class AdaptiveDraftLength:
    """Owns each request's acceptance average and decides its draft length every step."""

    def __init__(self, max_k: int, min_acceptance: float, enabled: bool = True) -> None:
        self.max_k = max_k
        self.log_min = math.log(min_acceptance) if min_acceptance > 0 else -math.inf
        self.enabled = enabled
        self._states: dict[str, _State] = {}

    def num_drafts(self, req_id: str) -> int:
        """Draft tokens to propose for ``req_id`` now (advances its probe clock)."""
        if not self.enabled:
            return self.max_k
        st = self._states.get(req_id)
        if st is None:
            return self.max_k
        k = self._k(st)
        if k > 0:
            return k
        if st.wait > 0:
            st.wait -= 1
            return 0
        return 1  # a probe

    def _k(self, st: _State) -> int:
        a = st.accepted / st.tried if st.tried > 0 else 1.0
        if a >= 1.0 - 1e-9:
            return self.max_k
        if a <= 0.0:
            return 0
        return max(0, min(self.max_k, int(self.log_min / math.log(a))))

    def observe(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        """The outcome of one verification of ``num_drafted`` tokens."""
        if num_drafted <= 0:
            return
        st = self._states.get(req_id)
        if st is None:
            st = self._states[req_id] = _State()
        was_zero = self._k(st) == 0
        tried = num_accepted + (1 if num_accepted < num_drafted else 0)
        st.accepted = DECAY * st.accepted + num_accepted
        st.tried = DECAY * st.tried + tried
        if self._k(st) == 0:
            # Failed (or first failing) probe: wait longer before the next one.
            st.backoff = min(MAX_BACKOFF, st.backoff * 2) if was_zero else MIN_BACKOFF
            st.wait = st.backoff
        else:
            st.backoff = MIN_BACKOFF

    def acceptance(self, req_id: str) -> float:
        st = self._states.get(req_id)
        return 1.0 if st is None else st.accepted / st.tried

    def remove(self, req_id: str) -> None:
        self._states.pop(req_id, None)
