"""A periodic log line for operators, like vLLM's: throughput and queue state every few seconds
while the server is busy (silent when idle)."""
from __future__ import annotations

import logging
import time

from llmtower.core.outputs import SchedulerStats

logger = logging.getLogger("llmtower.stats")


class LoggingStatLogger:
    """Owns the token counts since the last log line and when that line was written."""

    def __init__(self, interval_s: float = 10.0, enabled: bool = True) -> None:
        self.interval_s = interval_s
        self.enabled = enabled  # --disable-log-stats turns the line off
        self._last_time = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0

    def record_tokens(self, num_prompt: int, num_generation: int) -> None:
        self._prompt_tokens += num_prompt
        self._generation_tokens += num_generation

    def maybe_log(self, stats: SchedulerStats | None) -> None:
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval_s or stats is None or not self.enabled:
            return
        if self._prompt_tokens or self._generation_tokens or stats.num_running_reqs:
            logger.info(
                "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, "
                "running: %d reqs, waiting: %d reqs, swapped: %d reqs, KV cache usage: %.1f%%, "
                "prefix cache hit rate: %.1f%%, preemptions: %d",
                self._prompt_tokens / elapsed, self._generation_tokens / elapsed,
                stats.num_running_reqs, stats.num_waiting_reqs, stats.num_swapped_reqs,
                100 * stats.kv_cache_usage,
                100 * stats.prefix_cache_hits / max(1, stats.prefix_cache_queries),
                stats.num_preemptions_total)
        self._last_time = now
        self._prompt_tokens = self._generation_tokens = 0
