"""Whether the fused decode layers prefetch the next attention's K/V during their float32
products (``decode_layer.c``'s ``decode_layer_prefetch_kv``), decided by timing this machine's
own decode steps.

The stream moves ~20 MB of K and V per layer (SmolLM2, 64 requests) into L2 while the products
run, so that the attention that follows finds it in cache. Whether that pays depends on what
the cache does with lines pushed out of a small L2 before they are read:

- AMD EPYC (Zen 4/5, AVX-512): the next attention read them back from L3; 64-prompt float32
  throughput +5-7% with the stream (docs/performance.md, issue 9's fused decode layer);
- an Intel Xeon VM (2 vCPUs, 2 MB L2): the products ran 16% longer (their own weight streams
  wait behind the prefetches) and the attention only 9% shorter: -4 to -6% end to end at
  both the native level and emulated AVX2 (issue 28; docs/performance.md).

Neither the vendor nor the cache sizes say which a machine is, so the engine asks its steps:
the first ``pairs`` pairs of consecutive decode steps of at least ``min_rows`` rows run one with
the stream and one without (which goes first alternates), each pair of the same row count
(consecutive steps of a batch differ by one token of context), and the setting whose steps
took less time in most pairs, by the median ratio, is kept for the engine's life. The two
settings compute the same values bit for bit (a prefetch only brings lines into a cache), so
the trial changes timing only. Steps of fewer rows run without the stream until the trial has
decided (their K/V is too little to matter or to tell). ``LLMTOWER_PREFETCH_KV=1`` / ``0``
fixes the setting instead.
"""
from __future__ import annotations

import logging
import os
import statistics

ENV = "LLMTOWER_PREFETCH_KV"
logger = logging.getLogger(__name__)


class KvPrefetchChoice:
    """Owns the trial of the K/V prefetch stream: the pairs timed so far and, once decided,
    the setting every later step uses.

    ``setting(rows)`` gives the value for the next step; ``record(rows, seconds)`` reports the
    time that step's C call took. ``fixed`` (True / False) skips the trial."""

    def __init__(self, fixed: bool | None = None, pairs: int = 6, min_rows: int = 16,
                 margin: float = 0.01) -> None:
        self.pairs, self.min_rows, self.margin = pairs, min_rows, margin
        self.decided: bool | None = fixed
        self.ratios: list[float] = []  # per pair: time with the stream / time without
        self._pending: tuple[int, bool, float] | None = None  # (rows, setting, seconds)
        self._trying: bool | None = None

    @classmethod
    def from_env(cls) -> KvPrefetchChoice:
        """The trial, or the setting ``LLMTOWER_PREFETCH_KV`` fixes (``1`` / ``0``)."""
        raw = os.environ.get(ENV, "").strip().lower()
        if raw in ("", "auto"):
            return cls()
        if raw in ("1", "on", "true"):
            return cls(fixed=True)
        if raw in ("0", "off", "false"):
            return cls(fixed=False)
        raise ValueError(f"{ENV}={raw!r}: use 1 (prefetch the next attention's K/V in the "
                         f"decode products), 0 (don't) or auto (time both, keep the faster)")

    def setting(self, rows: int) -> bool:
        """Whether the next step (of ``rows`` rows) prefetches."""
        if self.decided is not None:
            return self.decided
        if rows < self.min_rows:
            self._trying = None  # too small to tell; not part of a pair
            return False
        if self._pending is not None and self._pending[0] == rows:
            self._trying = not self._pending[1]  # the pair's second step: the other setting
        else:
            self._trying = len(self.ratios) % 2 == 0  # alternate which setting goes first
        return self._trying

    def record(self, rows: int, seconds: float) -> None:
        """The time of the step ``setting(rows)`` was last asked for."""
        if self.decided is not None or self._trying is None:
            return
        p = self._pending
        if p is None or p[0] != rows or p[1] == self._trying:
            self._pending = (rows, self._trying, seconds)
            return
        on, off = (p[2], seconds) if p[1] else (seconds, p[2])
        self._pending = None
        if on > 0 and off > 0:
            self.ratios.append(on / off)
        if len(self.ratios) >= self.pairs:
            # ties (within the margin) go without the stream: less memory traffic for the
            # same speed
            ratio = statistics.median(self.ratios)
            self.decided = ratio < 1.0 - self.margin
            logger.info("decode steps %s the next attention's K/V during their products: "
                        "with the stream a step took %.3fx the time without (median of %d "
                        "pairs; %s=0/1 fixes it)", "prefetch" if self.decided else
                        "do not prefetch", ratio, len(self.ratios), ENV)
