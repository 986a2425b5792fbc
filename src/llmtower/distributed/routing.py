"""Which data-parallel engine gets a new request: the head's load balancer, also used by the
simulator's cluster mode so that both are studied with the same rule.

Load. Each engine's load is what it really holds, from its latest stats snapshot (waiting and
running requests, KV usage), and never less than the requests this server has sent it since
(a snapshot is up to half a second old):

    load(e) = max(in_flight(e), waiting(e) + running(e)) + KV_WEIGHT * kv_usage(e)

Prefix affinity (beyond vLLM's default). A request whose first blocks hash like those of an
earlier request goes where that one went, as long as that engine's load is within
``slack`` of the least loaded: its prefix cache probably still holds those blocks. The table
of first-block hashes is bounded (LRU).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# One fully used KV cache counts like this many queued requests.
KV_WEIGHT = 4.0


@dataclass
class EngineLoad:
    """What the router knows of one engine."""

    in_flight: int = 0
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    alive: bool = True

    @property
    def score(self) -> float:
        return max(self.in_flight, self.waiting + self.running) + KV_WEIGHT * self.kv_usage


def prefix_keys(token_ids: list[int], block_size: int, max_blocks: int) -> list[bytes]:
    """Chained digests of the first full blocks of a prompt: key k covers blocks 0..k."""
    keys: list[bytes] = []
    num_blocks = min(max_blocks, len(token_ids) // block_size)
    raw = array("q", token_ids[:num_blocks * block_size]).tobytes()  # one copy, C speed
    step = block_size * 8
    h = hashlib.blake2b(digest_size=16)
    for k in range(num_blocks):
        h.update(raw[k * step:(k + 1) * step])
        keys.append(h.copy().digest())
    return keys


class Router:
    """Owns the prefix-affinity table and the choice of an engine for each request."""

    def __init__(self, block_size: int, prefix_aware: bool = True, max_prefix_blocks: int = 8,
                 table_size: int = 65536, slack: float = 4.0) -> None:
        self.block_size = block_size
        self.prefix_aware = prefix_aware
        self.max_prefix_blocks = max_prefix_blocks
        self.table_size = table_size
        self.slack = slack
        self._table: OrderedDict[bytes, int] = OrderedDict()
        self._next = 0  # tie-break among equally loaded engines: the next in turn
        self.num_affinity_hits = 0
        self.num_routed = 0

    def choose(self, loads: list[EngineLoad], token_ids: list[int] | None = None,
               eligible: Sequence[bool] | None = None) -> int:
        """The engine for a request, among the alive ones (and, if ``eligible`` is given,
        those it marks True: e.g. not draining, heard from lately); raises ValueError when
        there is none."""
        n = len(loads)
        order = [(self._next + k) % n for k in range(n)]
        alive = [e for e in order if loads[e].alive and (eligible is None or eligible[e])]
        if not alive:
            raise ValueError("no data-parallel engine is alive")
        best = min(alive, key=lambda e: loads[e].score)
        keys = prefix_keys(token_ids, self.block_size, self.max_prefix_blocks) \
            if self.prefix_aware and token_ids else []
        chosen = best
        for key in reversed(keys):  # the longest shared prefix first
            e = self._table.get(key)
            if e is not None and e < n and loads[e].alive and \
                    (eligible is None or eligible[e]) and loads[e].score <= loads[best].score + self.slack:
                chosen = e
                self.num_affinity_hits += 1
                break
        for key in keys:
            self._table[key] = chosen
            self._table.move_to_end(key)
        while len(self._table) > self.table_size:
            self._table.popitem(last=False)
        if chosen == best:
            self._next = (best + 1) % n
        self.num_routed += 1
        return chosen

    def forget_engine(self, engine: int) -> None:
        """An engine was lost: its cache is gone, so are its affinities."""
        for key in [k for k, e in self._table.items() if e == engine]:
            del self._table[key]
