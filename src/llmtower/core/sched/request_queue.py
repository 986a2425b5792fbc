"""The waiting queue, ordered by the scheduling policy.

- ``FCFSQueue``: a deque in arrival order; preempted requests go back to the front.
- ``HeapQueue``: a heap on a policy key (``priority``: (priority, arrival, seq); ``sjf``:
  predicted work plus aging, see ``policy.py``), with the admission sequence number ``seq`` as
  the last tie-break so that the order is strict even when arrival times are equal.

Removal (abort, a late stop, a priority change) is lazy: the queue keeps a removed entry and
skips it when it reaches the front, so removal never costs an O(n) search. **Removal belongs
to the entry, not to the request id**: every ``add`` creates an entry with a fresh number,
stored on the request as ``queue_entry``; an entry is live only while the request still
points at it. Ids of finished or aborted requests are free for reuse, so a new request with
an old id is a different entry and the stale one can never come back to life.

``num_tokens`` is the exact sum of the queued requests' tokens: each request remembers what
the queue counted for it (``queued_tokens``), and a token appended to a queued request (a
late output of a step that was in flight when it was preempted) is counted with ``grow``.
"""
from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from llmtower.core.request import Request


class RequestQueue(ABC):
    """Owns the waiting requests in policy order, with O(1)/O(log n) add, pop and removal."""

    def __init__(self) -> None:
        self._len = 0
        self.num_tokens = 0  # tokens of the requests in the queue (admission limits)
        self._entries = itertools.count(1)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def _on_add(self, req: Request) -> int:
        if req.queue_entry:
            raise RuntimeError(f"request {req.request_id!r} is already in the waiting queue")
        entry = next(self._entries)
        req.queue_entry = entry
        req.queued_tokens = req.num_tokens
        self._len += 1
        self.num_tokens += req.queued_tokens
        return entry

    def _on_pop(self, req: Request) -> None:
        req.queue_entry = 0
        self._len -= 1
        self.num_tokens -= req.queued_tokens
        req.queued_tokens = 0

    def remove(self, req: Request) -> None:
        """Kill the request's live entry (no-op if it has none); skipped lazily later."""
        if req.queue_entry:
            self._on_pop(req)

    def grow(self, req: Request, num_tokens: int) -> None:
        """``num_tokens`` were appended to a queued request: count them."""
        if req.queue_entry:
            req.queued_tokens += num_tokens
            self.num_tokens += num_tokens

    # Subclasses implement the ordering.
    @abstractmethod
    def add(self, req: Request) -> None: ...
    @abstractmethod
    def add_front(self, req: Request) -> None: ...
    @abstractmethod
    def peek(self) -> Request: ...
    @abstractmethod
    def pop(self) -> Request: ...
    @abstractmethod
    def prepend(self, reqs: list[Request]) -> None: ...
    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def rekey(self, req: Request) -> None:
        """The request's ordering key changed (e.g. its priority): re-insert it."""
        if req.queue_entry:
            self._on_pop(req)
            req.sort_key = ()
            self.add(req)


class FCFSQueue(RequestQueue):
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        super().__init__()
        self._q: deque[tuple[int, Request]] = deque()

    def add(self, req: Request) -> None:
        self._q.append((self._on_add(req), req))

    def add_front(self, req: Request) -> None:
        self._q.appendleft((self._on_add(req), req))

    def _drop_dead(self) -> None:
        q = self._q
        while q and q[0][1].queue_entry != q[0][0]:
            q.popleft()

    def peek(self) -> Request:
        self._drop_dead()
        return self._q[0][1]

    def pop(self) -> Request:
        self._drop_dead()
        req = self._q.popleft()[1]
        self._on_pop(req)
        return req

    def prepend(self, reqs: list[Request]) -> None:
        entries = [(self._on_add(r), r) for r in reqs]
        self._q.extendleft(reversed(entries))

    def __iter__(self) -> Iterator[Request]:
        return (r for e, r in self._q if r.queue_entry == e)


class HeapQueue(RequestQueue):
    """A heap on ``key(req)``, computed once per request (a preempted request keeps its place);
    ties broken by entry number, though every policy key already ends with ``seq``."""

    def __init__(self, key: Callable[[Request], tuple]) -> None:
        super().__init__()
        self._key = key
        self._heap: list[tuple[tuple, int, Request]] = []

    def add(self, req: Request) -> None:
        if not req.sort_key:
            req.sort_key = self._key(req)
        heapq.heappush(self._heap, (req.sort_key, self._on_add(req), req))

    add_front = add  # a preempted request keeps its key, which puts it before later arrivals

    def _drop_dead(self) -> None:
        h = self._heap
        while h and h[0][2].queue_entry != h[0][1]:
            heapq.heappop(h)

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
                if e[2].queue_entry == e[1])
