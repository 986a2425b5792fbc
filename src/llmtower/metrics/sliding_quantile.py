"""A quantile over the last minute of observations, for ``llmtower:request_queue_time_p99_seconds``
(tools that cannot run ``histogram_quantile`` read it as a plain gauge)."""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable


class SlidingWindowQuantile:
    """Owns the (time, value) observations of the last ``window_s`` seconds, at most
    ``max_samples`` of them (the oldest go first), and answers a quantile over them."""

    def __init__(self, q: float, window_s: float = 60.0, max_samples: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 < q <= 1.0:
            raise ValueError(f"quantile q={q} must be in (0, 1]")
        self.q = q
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def observe(self, value: float) -> None:
        self._samples.append((self.clock(), value))

    def value(self) -> float:
        """The ``q`` quantile (nearest rank) of the window; 0 when it is empty."""
        cutoff = self.clock() - self.window_s
        samples = self._samples
        while samples and samples[0][0] < cutoff:
            samples.popleft()
        if not samples:
            return 0.0
        ordered = sorted(v for _, v in samples)
        return ordered[max(0, math.ceil(self.q * len(ordered)) - 1)]
