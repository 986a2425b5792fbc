"""``--policy fair``: per-tenant fairness with the Virtual Token Counter (VTC; Sheng et al.,
"Fairness in Serving Large Language Models", OSDI'24).

- Each tenant has a counter that grows by the tokens served to it (prefill and decode, each
  token counted once when it is scheduled, given back if the request is preempted before its
  step runs), divided by the tenant's weight (``--tenant-weights a=2,b=1``; default 1).
- Admission takes the oldest waiting request of the tenant with the **smallest** counter.
- A tenant that comes back after idling (no request waiting or running) has its counter
  lifted to the smallest counter among the active tenants, less a credit against tenants
  with requests waiting (at most ``return_credit``, two steps' token budget, and at most what
  that tenant was served in its current busy period; none against a tenant with nothing
  waiting); at an empty scheduler, to the counter of the last tenant that went idle. The
  credit lets a returning light tenant displace the flood at once; its limits keep a flood
  returning while a light tenant runs from putting the light tenant's next arrivals behind
  two steps' budget of flood service.
- Displacement (a waiting request preempting a running one of *another* tenant, at the
  ``max_num_seqs`` and KV limits), by either rule (see ``displaces``): the victim's frozen
  rank (below) is above the waiting tenant's counter; or the live counter of the victim's
  tenant (the most-served other one; its cheapest request) exceeds the waiting tenant's by
  more than ``margin`` (one step's budget) plus, if the victim was preempted before, its own
  tokens. It never displaces its own tenant's requests.
- Victims at the KV limit of a running request (step 1 of a step) come from the tenant with
  the **largest** counter read when each request was (re)admitted: frozen while it runs, so
  the most protected running request is never the victim (see ``policy.py``: no livelock).

The guarantee (VTC): between two backlogged tenants the difference of their counters stays
within a bound of the order of one step's tokens plus one request's length, so their service
ratio converges to the ratio of their weights.

Cost: picking the next waiting request scans the tenants that have one waiting, O(tenants).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from llmtower.core.config import SchedulerConfig
from llmtower.core.request import Request
from llmtower.core.sched.policy import SchedulingPolicy
from llmtower.core.sched.request_queue import RequestQueue


class TenantStats:
    """What one tenant was served (for metrics and the operator)."""

    __slots__ = ("tokens_served", "num_admitted", "queue_time_sum", "num_unfinished",
                 "busy_from")

    def __init__(self) -> None:
        self.tokens_served = 0
        self.num_admitted = 0  # first admissions
        self.queue_time_sum = 0.0  # seconds from queueing to first admission
        self.num_unfinished = 0
        self.busy_from = 0.0  # its counter when its current busy period began

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class FairQueue(RequestQueue):
    """One FIFO per tenant; the front is the head of the tenant with the smallest counter
    (ties: the earliest head)."""

    def __init__(self, counters: dict[str, float]) -> None:
        super().__init__()
        self._counters = counters
        self._fifos: dict[str, deque[tuple[int, Request]]] = {}
        self._live: dict[str, int] = {}  # live entries per tenant (tenants with 0 are dropped)

    def _on_add(self, req: Request) -> int:
        t = req.tenant
        self._live[t] = self._live.get(t, 0) + 1
        if t not in self._fifos:
            self._fifos[t] = deque()
        return super()._on_add(req)

    def _on_pop(self, req: Request) -> None:
        t = req.tenant
        left = self._live[t] - 1
        if left:
            self._live[t] = left
        else:
            del self._live[t]
            del self._fifos[t]  # only dead entries were left in it
        super()._on_pop(req)

    def add(self, req: Request) -> None:
        entry = self._on_add(req)
        self._fifos[req.tenant].append((entry, req))

    def add_front(self, req: Request) -> None:
        entry = self._on_add(req)
        self._fifos[req.tenant].appendleft((entry, req))

    def prepend(self, reqs: list[Request]) -> None:
        for r in reversed(reqs):
            self.add_front(r)

    def waiting_tenants(self) -> dict[str, int]:
        """Tenants with requests in the queue, and how many."""
        return self._live

    def _head(self, t: str) -> Request:
        q = self._fifos[t]
        while q[0][1].queue_entry != q[0][0]:
            q.popleft()
        return q[0][1]

    def _pick(self) -> str:
        counters = self._counters
        best_t, best = "", None
        for t in self._live:
            h = self._head(t)
            key = (counters.get(t, 0.0), h.arrival_time, h.seq)
            if best is None or key < best:
                best_t, best = t, key
        return best_t

    def peek(self) -> Request:
        if not self._live:
            raise IndexError("peek from an empty queue")
        return self._head(self._pick())

    def pop(self) -> Request:
        req = self.peek()
        self._fifos[req.tenant].popleft()
        self._on_pop(req)
        return req

    def __iter__(self) -> Iterator[Request]:
        live = [r for q in self._fifos.values() for e, r in q if r.queue_entry == e]
        return iter(sorted(live, key=lambda r: (self._counters.get(r.tenant, 0.0),
                                                r.arrival_time, r.seq)))


class FairPolicy(SchedulingPolicy):
    """Owns the tenants' virtual token counters and per-tenant statistics."""

    name = "fair"
    may_displace = True

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.weights = dict(config.tenant_weights)
        self.counters: dict[str, float] = {}
        self.stats: dict[str, TenantStats] = {}
        self._rank: dict[int, float] = {}  # seq -> the tenant's counter at (re)admission
        # The counter of the last tenant that went idle: the level a tenant returning to an
        # empty scheduler is lifted to (as VTC does), else a tenant new or long idle would
        # come back owed everything the others were served meanwhile.
        self._idle_level = 0.0
        # Two steps' token budget: above ``margin`` (one step's), so that a returning tenant
        # displaces at once. A max_model_len cap was too small before: with
        # --max-model-len 512 and a budget of 2048 that left a returning light tenant about
        # three requests of credit, and a burst of its own requests (128 output tokens each,
        # two sequence slots) then waited for the flooding tenant's requests to finish: the
        # light p99 TTFT in steps went from 1.0x to 2.5x of its unloaded value
        # (benchmarks/tenant_fairness_steps.py, seed 1). The credit is within VTC's bound.
        self.return_credit = 2.0 * config.max_num_batched_tokens
        # Displacement hysteresis (weighted tokens), see ``displaces``.
        self.margin = float(config.max_num_batched_tokens)
        self.charge = self._charge
        self._queue: FairQueue | None = None

    def make_queue(self) -> RequestQueue:
        self._queue = FairQueue(self.counters)
        return self._queue

    def rank(self, req: Request) -> float:
        return self._rank.get(req.seq, 0.0)

    def displaces(self, waiting: Request, victim: Request) -> bool:
        """Either rule, only against another tenant:

        - frozen (as before): the victim's rank, its tenant's counter when it was admitted,
          is above the waiting tenant's counter now. Counters only grow, so the victim's
          tenant is the more served one, and a displaced request, ranked higher when it
          comes back, can never displace the request that displaced it;
        - live: the victim's tenant's counter now exceeds the waiting tenant's by more than
          ``margin`` (one step's budget) plus, if the victim was preempted before, its own
          tokens (prompt and outputs, which it recomputes or swaps back). This one reaches a
          flood's requests admitted long ago, whose frozen rank fell behind. Undoing such a
          displacement needs the gap to move by twice the margin, more than one step can
          move it (a refund and a prefill, each within the budget), and the protection of a
          once-preempted request means its own progress never makes it a victim again: two
          long requests cannot displace each other in turn for ever, recomputing each time.
        """
        if victim.tenant == waiting.tenant:
            return False
        counters = self.counters
        mine = counters.get(waiting.tenant, 0.0)
        return (self.rank(victim) > mine
                or counters.get(victim.tenant, 0.0) - mine > self.margin + self._protection(victim))

    def _protection(self, req: Request) -> float:
        return req.num_tokens / self.weights.get(req.tenant, 1.0) if req.num_preemptions else 0.0

    def displacement_victim(self, waiting: Request, running: list[Request]) -> Request | None:
        # First the frozen rule's victim (the largest frozen rank, as at the KV limit); else
        # the live rule's: the most-served other tenant's request that is cheapest to
        # displace (least protection, fewest tokens, then the latest admitted).
        if not running:
            return None
        victim = self.victim(running)
        if victim.tenant != waiting.tenant and self.rank(victim) > self.counters.get(
                waiting.tenant, 0.0):
            return victim
        counters = self.counters
        best: Request | None = None
        best_key: tuple = ()
        for r in running:
            if r.tenant == waiting.tenant:
                continue
            key = (counters.get(r.tenant, 0.0), -self._protection(r), -r.num_tokens, r.seq)
            if best is None or key > best_key:
                best, best_key = r, key
        return best if best is not None and self.displaces(waiting, best) else None

    def yields_budget(self, running: Request, waiting: Request) -> bool:
        # A running prefill of a tenant served at least as much as the waiting one (live
        # counters: a smaller chunk loses nothing, so no livelock argument is needed) leaves
        # it room. At least: a tenant returning level with the running one (no credit, as
        # against a tenant with nothing waiting) is the one VTC serves next.
        counters = self.counters
        return (running.tenant != waiting.tenant
                and counters.get(running.tenant, 0.0) >= counters.get(waiting.tenant, 0.0))

    def same_step_hit_ok(self, _req: Request, _owner: Request) -> bool:
        # Counters move during the scan (and back, when a displaced request is refunded), so
        # no order argument holds: never share blocks computed in this step.
        return False

    def _stats(self, tenant: str) -> TenantStats:
        s = self.stats.get(tenant)
        if s is None:
            s = self.stats[tenant] = TenantStats()
        return s

    def on_add(self, req: Request) -> None:
        t = req.tenant
        st = self._stats(t)
        if st.num_unfinished == 0:
            # A returning (or new) tenant starts level with the least-served active tenant
            # (VTC), less a credit against tenants with requests *waiting* (a backlog it may
            # displace at once): at most ``return_credit`` and at most what that tenant was
            # served in its current busy period. None against a tenant with nothing waiting,
            # nor at an empty scheduler: there the credit would only put that tenant's next
            # arrivals behind the returning one's backlog (a flood returning while a light
            # tenant ran one request made the light tenant wait for up to two steps' budget
            # of flood service: 0.5-1 s at --max-num-seqs 2, the real server's tail).
            counters = self.counters
            waiting = self._queue.waiting_tenants() if self._queue is not None else {}
            levels = [counters.get(a, 0.0) - (min(self.return_credit,
                                                  counters.get(a, 0.0) - s.busy_from)
                                              if a in waiting else 0.0)
                      for a, s in self.stats.items() if s.num_unfinished and a != t]
            floor = min(levels) if levels else self._idle_level
            counters[t] = max(counters.get(t, 0.0), floor)
            st.busy_from = counters[t]
        st.num_unfinished += 1

    def on_admit(self, req: Request) -> None:
        self._rank[req.seq] = self.counters.get(req.tenant, 0.0)
        if req.num_preemptions == 0:
            st = self._stats(req.tenant)
            st.num_admitted += 1
            st.queue_time_sum += max(0.0, req.times.first_scheduled - req.times.queued)

    def _charge(self, req: Request, num_tokens: int) -> None:
        t = req.tenant
        self.counters[t] = self.counters.get(t, 0.0) + num_tokens / self.weights.get(t, 1.0)
        self.stats[t].tokens_served += num_tokens

    def on_finish(self, req: Request) -> None:
        self._rank.pop(req.seq, None)
        st = self._stats(req.tenant)
        st.num_unfinished -= 1
        if st.num_unfinished == 0:
            self._idle_level = self.counters.get(req.tenant, 0.0)

    def tenant_stats(self) -> dict[str, dict]:
        return {t: {**s.as_dict(), "counter": self.counters.get(t, 0.0),
                    "weight": self.weights.get(t, 1.0)} for t, s in self.stats.items()}
