"""``vllm:lora_requests_info``: vLLM's info gauge of the adapters in use. Its labels are the
step limit and the comma-joined names of the adapters of running and waiting requests; its
value the time of the snapshot (set_to_current_time, as vLLM does)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from llmtower.core.outputs import SchedulerStats


class LoRAInfoGauge:
    """Owns the gauge and each engine's current label values: a new snapshot replaces the
    engine's previous series instead of leaving one per adapter set ever seen."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.gauge = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                           ["max_lora", "waiting_lora_adapters", "running_lora_adapters",
                            "engine"], registry=registry)
        self._last: dict[int, tuple[str, ...]] = {}

    def record(self, stats: SchedulerStats, engine: int = 0) -> None:
        if stats.max_lora <= 0:  # LoRA off: no series
            return
        labels = (str(stats.max_lora), ",".join(stats.waiting_lora_adapters),
                  ",".join(stats.running_lora_adapters), str(engine))
        old = self._last.get(engine)
        if old is not None and old != labels:
            self.gauge.remove(*old)
        self._last[engine] = labels
        self.gauge.labels(*labels).set_to_current_time()
