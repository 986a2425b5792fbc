"""The waiting queue, ordered by the scheduling policy.

- ``fcfs``: a deque in arrival order; preempted requests go back to the front.
- ``priority``: a heap on (priority, arrival time): lower value first, then earlier arrival.
- ``sjf``: a heap on predicted work plus aging. A request's effective size at time ``t`` is
  ``work - aging * (t - arrival)``; since ``aging * t`` is common to everyone at a given
  moment, the order is that of the constant key ``work + aging * arrival``, so a heap keeps
  it. A request of ``work`` W can be overtaken only by requests arriving within ``W / aging``
  seconds after it: its wait is bounded.

Removal (abort) is lazy: a removed request is only marked, and skipped when it reaches the
front, so aborting never costs an O(n) search.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterable, Iterator

from llmtower.core.request import Request


class RequestQueue:
    """Owns the waiting requests in policy order, with O(1)/O(log n) add, pop and removal."""

    def __init__(self) -> None:
        self._removed: set[str] = set()
        self._len = 0
        self.num_tokens = 0  # prompt tokens of the requests in the queue (admission limits)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def _on_add(self, req: Request) -> None:
        self._removed.discard(req.request_id)
        self._len += 1
        self.num_tokens += req.num_tokens

    def _on_pop(self, req: Request) -> None:
        self._len -= 1
        self.num_tokens -= req.num_tokens

    def remove(self, req: Request) -> None:
        self._removed.add(req.request_id)
        self._on_pop(req)

    def _is_live(self, req: Request) -> bool:
        if req.request_id in self._removed:
            self._removed.discard(req.request_id)
            return False
        return True

    # Subclasses implement the ordering.
    def add(self, req: Request) -> None: ...
    def add_front(self, req: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def prepend(self, reqs: list[Request]) -> None: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        super().__init__()
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._on_add(req)
        self._q.append(req)

    def add_front(self, req: Request) -> None:
        self._on_add(req)
        self._q.appendleft(req)

    def _drop_dead(self) -> None:
        while self._q and not self._is_live(self._q[0]):
            self._q.popleft()

    def peek(self) -> Request:
        self._drop_dead()
        return self._q[0]

    def pop(self) -> Request:
        self._drop_dead()
        req = self._q.popleft()
        self._on_pop(req)
        return req

    def prepend(self, reqs: list[Request]) -> None:
        for r in reqs:
            self._on_add(r)
        self._q.extendleft(reversed(reqs))

    def __iter__(self) -> Iterator[Request]:
        return (r for r in self._q if r.request_id not in self._removed)


class HeapQueue(RequestQueue):
    """A heap on ``key(req)``; ties broken by insertion order."""

    def __init__(self, key) -> None:
        super().__init__()
        self._key = key
        self._heap: list[tuple[tuple, int, Request]] = []
        self._seq = itertools.count()

    def add(self, req: Request) -> None:
        if not req.sort_key:
            req.sort_key = self._key(req)
        self._on_add(req)
        heapq.heappush(self._heap, (req.sort_key, next(self._seq), req))

    add_front = add  # a preempted request keeps its key, which puts it before later arrivals

    def _drop_dead(self) -> None:
        while self._heap and not self._is_live(self._heap[0][2]):
            heapq.heappop(self._heap)

    def peek(self) -> Request:
        self._drop_dead()
        return self._heap[0][2]

    def pop(self) -> Request:
        self._drop_dead()
        req = heapq.heappop(self._heap)[2]
        self._on_pop(req)
        return req

    def prepend(self, reqs: Iterable[Request]) -> None:
        for r in reqs:
            self.add(r)

    def __iter__(self) -> Iterator[Request]:
        return (e[2] for e in sorted(self._heap, key=lambda e: (e[0], e[1]))
                if e[2].request_id not in self._removed)


def make_request_queue(policy: str, sjf_aging_tokens_per_s: float = 100.0) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return HeapQueue(lambda r: (r.priority, r.arrival_time))
    if policy == "sjf":
        def sjf_key(r: Request) -> tuple:
            work = r.num_prompt_tokens + r.max_tokens
            return (work + sjf_aging_tokens_per_s * r.arrival_time, r.arrival_time)
        return HeapQueue(sjf_key)
    raise ValueError(f"policy={policy!r} is invalid: policy must be one of 'fcfs', 'priority', 'sjf'")
