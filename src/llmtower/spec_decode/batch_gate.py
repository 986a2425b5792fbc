"""Whether the batch drafts at all this step: the expected gain of speculation for the whole batch.

The per-request draft length (``adaptive.py``) prices an accepted token as a step saved for
its request. That holds for one stream, and in a batch whose freed slots are taken by waiting
requests; it does not hold for a batch that runs in lock step with nobody waiting (a burst
of requests that start together). There the batch takes as many steps as its slowest request,
so the steps saved per step are those of the *slowest* request, while every request's
rejected draft positions cost a row of every GEMM and some host time (proposing, verifying).
Accepted drafts cost nothing extra: each is a row the request would have decoded anyway.

So, per step of an open gate, each sampled request's tokens accepted and draft rows rejected
are averaged (decayed over the last few steps), and the batch keeps drafting while

    fixed_rows x min_i(accepted per step_i)  >=  sum_i(rejected per step_i) + host_rows

(``fixed_rows``: a step's fixed cost in rows, from ``step_cost.StepCostModel``; ``host_rows``:
the measured host time of drafting and verifying per step, in rows). A request that cannot
draft (penalties, logprobs, a grammar) is not judged: it would close the gate for good, and
such requests are usually of other lengths than the batch's.

One stream (B = 1) bypasses the gate: there the per-request rule is the same rule, exact, while
a window of a few steps of a request whose proposer finds no match would judge only noise.

When the rule fails the gate closes: the proposers skip their lookups and nobody drafts but
*soloists*: requests that accept at least ``SOLO_RATIO`` tokens per rejected row and one token
per step (a copy-heavy request in a batch of others). Their drafts do not shorten the batch,
but they cost it little and finish that request several times sooner. After a wait of 16, 32,
64, 128 steps (doubling while probes fail) the gate opens for a probe of at least
``MIN_OBSERVED`` steps, so a batch that starts copying later gets its drafts back; a request
joining the batch opens a probe at once. Requests that must draft from their own history alone (seeded sampled requests,
``independent``) and steps with requests waiting for a slot (an early finish admits the next
request at once, the per-request rule's case) bypass the gate.
"""
from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.7  # per step: the averages span the last ~3-4 steps
MIN_OBSERVED = 3  # steps a request is observed (since the gate opened) before it is judged
# 16, not 8: each probe drafts for MIN_OBSERVED steps of pure cost in a batch with nothing to
# copy; fresh batch 8 went from 0.95-0.96x to 0.99-1.00x of no speculation, copy batch 8 from
# 1.23-1.32x to 1.21-1.25x (benchmarks/spec_decode.py, quiet machine, alternated twice).
MIN_WAIT, MAX_WAIT = 16, 128
SOLO_RATIO, SOLO_MIN_ACCEPTED = 2.0, 1.0  # a soloist's accepted per rejected row, and per step


@dataclass
class _Rate:
    accepted: float = 0.0  # decayed sums per step
    rejected: float = 0.0
    weight: float = 0.0
    steps: int = 0  # steps observed


@dataclass
class GateDecision:
    """What the gate last weighed (for tests and the benchmark's report)."""

    gain_rows: float = 0.0
    cost_rows: float = 0.0
    judged: int = 0  # requests with enough observations


class BatchDraftGate:
    """Owns each request's recent accepted / rejected rates, the open-closed state of the
    batch's drafting and the probe back-off."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.is_open = True
        self.wait = 0  # steps left closed
        self.backoff = MIN_WAIT
        self.open_steps = 0  # steps since the gate (re)opened
        self.last = GateDecision()
        self.closed_steps_total = 0
        self._rates: dict[str, _Rate] = {}
        self._known: set[str] = set()  # requests of earlier steps (membership only)

    def observe(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        """One step's outcome for a request whose drafts were asked for (``num_drafted`` 0:
        its proposer or its adaptive length gave none, so it decoded one token)."""
        r = self._rates.get(req_id)
        if r is None:
            r = self._rates[req_id] = _Rate()
        r.accepted = DECAY * r.accepted + num_accepted
        r.rejected = DECAY * r.rejected + (num_drafted - num_accepted)
        r.weight = DECAY * r.weight + 1.0
        r.steps += 1

    def step(self, req_ids: list[str], fixed_rows: float, host_rows: float,
             num_waiting: int = 0) -> bool:
        """Decide for the next step of the batch ``req_ids`` (this step's sampled requests);
        returns whether it may draft."""
        if not self.enabled or num_waiting > 0 or len(req_ids) < 2:
            if not self.is_open:
                self._open()
            return True
        known = self._known
        newcomer = False
        for rid in req_ids:
            if rid not in known:
                known.add(rid)
                newcomer = True
        if not self.is_open:
            self.wait -= 1
            self.closed_steps_total += 1
            if self.wait > 0 and not newcomer:
                return False
            self._open()  # a probe: the wait is over, or a new request has not been judged
            return True
        self.open_steps += 1
        if self.open_steps <= MIN_OBSERVED and self.closed_steps_total:
            return True  # a probe: judge on the steps it measures, not on stale ones
        accepted: list[float] = []
        rejected = 0.0
        for rid in req_ids:
            r = self._rates.get(rid)
            if r is None or r.steps < MIN_OBSERVED:
                continue  # too new to judge: it neither blocks nor vouches
            accepted.append(r.accepted / r.weight)
            rejected += r.rejected / r.weight
        judged = len(accepted)
        if judged == 0:
            return True
        accepted.sort()
        # The slowest request's rate, but from 4 requests on the second slowest's: the least
        # of several few-step averages is biased low (one request between two copied spans).
        gain = fixed_rows * accepted[1 if judged >= 4 else 0]
        cost = rejected + host_rows
        self.last = GateDecision(gain, cost, judged)
        if gain >= cost:
            if self.open_steps >= MIN_OBSERVED:
                self.backoff = MIN_WAIT  # a probe that paid: start the back-off over
            return True
        self.is_open = False
        self.wait = self.backoff
        self.backoff = min(MAX_WAIT, self.backoff * 2)
        return False

    def solo(self, req_id: str) -> bool:
        """Whether ``req_id`` drafts while the gate is closed: it accepts enough per rejected
        row and per step (judged on its recent steps; a soloist keeps being measured)."""
        r = self._rates.get(req_id)
        return (r is not None and r.steps >= MIN_OBSERVED
                and r.accepted >= SOLO_RATIO * r.rejected
                and r.accepted >= SOLO_MIN_ACCEPTED * r.weight)

    def _open(self) -> None:
        """Open for a probe (the requests' averages go on: decayed, they soon follow it)."""
        self.is_open = True
        self.open_steps = 0
        self.wait = 0

    def remove(self, req_id: str) -> None:
        self._rates.pop(req_id, None)
        self._known.discard(req_id)
