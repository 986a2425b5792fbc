"""The mailbox between AsyncLLM's output handler and one request's ``generate()`` loop.

At saturation the handler hands every stream one output per engine step; asyncio.Queue's
get/put (its loop checks, getter deque and cancellation bookkeeping) was a tenth of the API
process's profiled CPU per token. One consumer and one producer on one event loop need much
less: a deque and at most one waiting future.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any


class OutputBox:
    """Owns one request's undelivered outputs (or the exception that ends it), in order, the
    future its one consumer waits on while there are none, and an optional ``sink``: a
    function that may deliver an item at once, in the producer's call, instead of waking the
    consumer (the server's direct lane for plain streamed tokens, server/direct_lane.py)."""

    __slots__ = ("_items", "_waiter", "sink")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[Any], bool] | None = None

    def put_nowait(self, item: Any) -> None:
        # The sink is offered an item only while the consumer waits on an empty box: then
        # everything before it has been handled, and delivering it now keeps the order.
        # It returns False (the item is queued as usual) for anything it does not take.
        if self._waiter is not None and not self._items and self.sink is not None \
                and self.sink(item):
            return
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get(self) -> Any:
        """The oldest item, waiting for one if there is none. Cancelling the wait (a timeout)
        loses nothing: items leave only when returned."""
        while not self._items:
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        return self._items.popleft()

    def qsize(self) -> int:
        return len(self._items)
