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

Cost-aware: the runner raises the threshold for the step with ``set_min_acceptance`` (from
``step_cost.StepCostModel``: in a big batch a draft row costs about what a real row does, so a
position must be accepted more often to pay). A request seen for the first time starts from the
pooled acceptance of all recent verifications (prior 0.8 before any), so where nothing is being
accepted a newcomer does not open with a full-length draft. Neither applies to a request asked
for ``independent`` lengths (a seeded sampled request: the drafts decide how its generator's
draws are used, so its tokens would depend on the batch and on the clock).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DECAY = 0.8
PRIOR_ACCEPTED, PRIOR_TRIED = 2.0, 2.5  # start optimistic (a = 0.8): drafts must prove useless
POOL_DECAY = 0.95  # the pooled average spans the last ~20 verifications of any request
MIN_BACKOFF, MAX_BACKOFF = 4, 64


@dataclass
class _State:
    accepted: float = PRIOR_ACCEPTED
    tried: float = PRIOR_TRIED
    backoff: int = MIN_BACKOFF
    wait: int = 0  # steps left before the next probe while K = 0


class AdaptiveDraftLength:
    """Owns each request's acceptance average, the pooled average over all requests and the
    step's threshold, and decides every request's draft length each step."""

    def __init__(self, max_k: int, min_acceptance: float, enabled: bool = True) -> None:
        self.max_k = max_k
        self.min_acceptance = min_acceptance
        self.log_min = self.log_min_own = (math.log(min_acceptance) if min_acceptance > 0
                                           else -math.inf)
        self.enabled = enabled
        self._states: dict[str, _State] = {}
        self._pool = _State()  # all requests' verifications, for newcomers

    def set_min_acceptance(self, step_min: float) -> None:
        """This step's threshold: the configured one, or ``step_min`` where higher (the cost
        of a draft row in a step of this size)."""
        m = max(self.min_acceptance, step_min)
        self.log_min = math.log(m) if m > 0 else -math.inf

    def num_drafts(self, req_id: str, independent: bool = False) -> int:
        """Draft tokens to propose for ``req_id`` now (advances its probe clock).
        ``independent``: from the request's own history and the configured threshold only."""
        if not self.enabled:
            return self.max_k
        log_min = self.log_min_own if independent else self.log_min
        st = self._states.get(req_id)
        if st is None:  # no verification yet: the prior's, or what the pool's acceptance affords
            return self._k(_State(), log_min) if independent else max(1, self._k(self._pool))
        k = self._k(st, log_min)
        if k > 0:
            return k
        if st.wait > 0:
            st.wait -= 1
            return 0
        return 1  # a probe

    def _k(self, st: _State, log_min: float | None = None) -> int:
        a = st.accepted / st.tried if st.tried > 0 else 1.0
        if a >= 1.0 - 1e-9:
            return self.max_k
        if a <= 0.0:
            return 0
        lm = self.log_min if log_min is None else log_min
        return max(0, min(self.max_k, int(lm / math.log(a))))

    def observe(self, req_id: str, num_drafted: int, num_accepted: int,
                independent: bool = False) -> None:
        """The outcome of one verification of ``num_drafted`` tokens (``independent`` as in
        ``num_drafts``)."""
        if num_drafted <= 0:
            return
        tried = num_accepted + (1 if num_accepted < num_drafted else 0)
        pool = self._pool
        pool.accepted = POOL_DECAY * pool.accepted + num_accepted
        pool.tried = POOL_DECAY * pool.tried + tried
        st = self._states.get(req_id)
        if st is None and independent:
            st = self._states[req_id] = _State()
        elif st is None:  # starts from the pool's average, with the prior's weight
            a = pool.accepted / pool.tried
            st = self._states[req_id] = _State(accepted=a * PRIOR_TRIED, tried=PRIOR_TRIED)
        log_min = self.log_min_own if independent else self.log_min
        was_zero = self._k(st, log_min) == 0
        st.accepted = DECAY * st.accepted + num_accepted
        st.tried = DECAY * st.tried + tried
        if self._k(st, log_min) == 0:
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
