"""Scheduling policies. A policy is a waiting-queue ordering plus a preemption-victim rule;
``schedule()`` asks the policy and never tests which policy it is.

Victim order (the running request to preempt is the *largest* key):

  (rank, work, arrival_time, seq)

- ``rank``: the policy's idea of importance, higher = preempted first: the request's
  ``priority`` value (always 0 under ``fcfs`` / ``sjf``), or under ``fair`` the tenant's
  virtual token counter when the request was (re)admitted.
- ``work``: 0 with ``--preemption-victim priority`` (the default: latest arrival first);
  with ``remaining``, the request's predicted remaining decode tokens, so that among equally
  ranked requests the one furthest from finishing is preempted and almost-finished ones keep
  their blocks.
- ``arrival_time`` then ``seq`` (the admission sequence number): latest first. ``seq`` makes
  the order strict: two requests with the same arrival time (``n > 1`` children share the
  parent's) can never preempt each other in turn.

No policy livelocks: every key component of a running request is fixed while it runs, or only
moves it towards "preempted later" (``remaining`` shrinks as it decodes), and a preempted
request is re-ranked only when it is admitted again, never downwards past the request that
displaced it. So the most protected running request is never a victim while another one
runs, and it always fits alone (admission caps every request to the whole KV cache).
"""
from __future__ import annotations

from collections.abc import Callable

from llmtower.core.config import SchedulerConfig
from llmtower.core.request import Request
from llmtower.core.sched.output_predictor import OutputLengthPredictor
from llmtower.core.sched.request_queue import FCFSQueue, HeapQueue, RequestQueue


class SchedulingPolicy:
    """Owns the waiting-queue order and the victim rule of one scheduler (base: ``fcfs``)."""

    name = "fcfs"
    # Whether requests carry priorities (anything else refuses a non-zero priority).
    uses_priority = False
    # Whether a waiting request may preempt strictly less important running requests.
    may_displace = False

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.remaining_victims = config.preemption_victim == "remaining"
        self.victim_key: Callable[[Request], tuple] = (
            self._victim_key_remaining if self.remaining_victims else self._victim_key_arrival)
        # Called with (request, tokens) for every token scheduled (negative: given back);
        # None when the policy does not account service, so the hot path skips the call.
        self.charge: Callable[[Request, int], None] | None = None

    # ---------------------------------------------------------------- queue
    def make_queue(self) -> RequestQueue:
        return FCFSQueue()

    # ---------------------------------------------------------------- victims
    def rank(self, req: Request) -> float:
        return req.priority

    def predicted_output(self, req: Request) -> float:
        """Total output tokens expected for ``req`` (its cap, unless the policy predicts)."""
        return req.max_tokens

    def _victim_key_arrival(self, r: Request) -> tuple:
        return (self.rank(r), 0.0, r.arrival_time, r.seq)

    def _victim_key_remaining(self, r: Request) -> tuple:
        left = max(0.0, self.predicted_output(r) - r.num_output_tokens)
        return (self.rank(r), left, r.arrival_time, r.seq)

    def victim(self, running: list[Request]) -> Request:
        return max(running, key=self.victim_key)

    def displaces(self, _waiting: Request, _victim: Request) -> bool:
        """May the waiting request preempt the running victim (only when ``may_displace``)?
        Never, by default."""
        return False

    def displacement_victim(self, waiting: Request, running: list[Request]) -> Request | None:
        """The running request that ``waiting`` preempts at the ``max_num_seqs`` or KV limit
        (only when ``may_displace``), or None: by default the victim, if ``displaces`` allows."""
        if not running:
            return None
        victim = self.victim(running)
        return victim if self.displaces(waiting, victim) else None

    def yields_budget(self, _running: Request, _waiting: Request) -> bool:
        """Does the running request's prefill chunk leave room in this step's budget for the
        waiting head's prompt (budget reservation, only when ``may_displace``)? Never, by
        default. Shrinking a chunk loses no work, so live state may decide."""
        return False

    def same_step_hit_ok(self, _req: Request, _owner: Request) -> bool:
        """May a request hit blocks that their owner computes in this very step? Only if nobody
        scanned after the request in this step can displace the owner (a displaced owner never
        computes them); always, by default (no policy that displaces)."""
        return True

    # ---------------------------------------------------------------- lifecycle hooks
    def on_add(self, req: Request) -> None:
        """``req`` entered the scheduler (before its first queueing)."""

    def on_admit(self, req: Request) -> None:
        """``req`` leaves ``waiting`` for ``running`` (first time or after a preemption)."""

    def on_finish(self, req: Request) -> None:
        """``req`` left the scheduler for good (its status says how)."""

    def tenant_stats(self) -> dict[str, dict[str, float]]:
        """Service per tenant (only ``fair`` accounts it)."""
        return {}


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` value first, then arrival; higher values are preempted first, and a
    waiting request may preempt strictly lower-priority running ones."""

    name = "priority"
    uses_priority = True
    may_displace = True

    def make_queue(self) -> RequestQueue:
        return HeapQueue(lambda r: (r.priority, r.arrival_time, r.seq))

    def displaces(self, waiting: Request, victim: Request) -> bool:
        return victim.priority > waiting.priority

    def yields_budget(self, running: Request, waiting: Request) -> bool:
        return running.priority > waiting.priority

    def same_step_hit_ok(self, req: Request, owner: Request) -> bool:
        # The scan goes in priority order: everyone after req is no more important than req,
        # so an owner at least as important as req cannot be displaced later in this step.
        return owner.priority <= req.priority


class SJFPolicy(SchedulingPolicy):
    """Shortest predicted work (prompt + predicted output) first, with aging.

    A request's effective size at time ``t`` is ``work - aging * (t - arrival)``; since
    ``aging * t`` is common to everyone at a given moment, the order is that of the constant
    key ``work + aging * arrival``, so a heap keeps it exactly. A request of ``work`` W can be
    overtaken only by requests arriving within ``W / aging`` seconds after it: its wait is
    bounded. The output length comes from ``OutputLengthPredictor`` (learned online from
    finished requests), not from ``max_tokens``; the prediction is taken once, at admission,
    so that a request's place and victim rank do not move while it waits or runs.
    """

    name = "sjf"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.predictor = OutputLengthPredictor()
        self._predicted: dict[int, float] = {}  # seq -> predicted output tokens

    def predicted_output(self, req: Request) -> float:
        return self._predicted.get(req.seq, req.max_tokens)

    def on_add(self, req: Request) -> None:
        self._predicted[req.seq] = min(float(req.max_tokens),
                                       self.predictor.predict(req.num_prompt_tokens))

    def make_queue(self) -> RequestQueue:
        aging = self.config.sjf_aging_tokens_per_s

        def key(r: Request) -> tuple:
            work = r.num_prompt_tokens + self.predicted_output(r)
            return (work + aging * r.arrival_time, r.arrival_time, r.seq)
        return HeapQueue(key)

    def on_finish(self, req: Request) -> None:
        self._predicted.pop(req.seq, None)
        if req.status.finish_reason in ("stop", "length"):
            self.predictor.observe(req.num_prompt_tokens, req.num_output_tokens)


def make_policy(config: SchedulerConfig) -> SchedulingPolicy:
    """The policy object for ``config.policy`` (the one place that reads the name)."""
    from llmtower.core.sched.fair_policy import FairPolicy
    classes: dict[str, type[SchedulingPolicy]] = {
        "fcfs": SchedulingPolicy, "priority": PriorityPolicy, "sjf": SJFPolicy,
        "fair": FairPolicy}
    return classes[config.policy](config)
