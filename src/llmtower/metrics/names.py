"""The operator-facing metric names of the design documents (``scheduler.queue_depth``,
``input_queue.size``, ``scheduler.preempt_count``, ...) mapped, in this one table, to the
Prometheus series that carry them. ``llmtower monitor --metric NAME`` and docs/operations.md
read it; the design's dashboard spelling (``scheduler/step_delay_ms``) is accepted too.

How the monitor shows each kind over one polling interval:
  gauge     the latest value (summed or averaged over engines for the total row)
  counter   the total so far and its rate per second over the interval
  histogram p50 and p99 of what was observed during the interval
  ratio     rate(numerator) / rate(denominator) over the interval
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SeedMetric:
    """One dotted name: its Prometheus series (a second one, the denominator, for a ratio),
    the label values that select it, how engines add up, and the design's health rule."""

    dotted: str
    prom: str
    kind: str  # "gauge" | "counter" | "histogram" | "ratio"
    doc: str
    labels: dict[str, str] = field(default_factory=dict)
    denominator: str | None = None
    aggregate: str = "sum"  # gauges over engines: "sum" or "mean"
    # Healthy when the value (histograms: the p99) is below ``max_ok`` / above ``min_ok``.
    max_ok: float | None = None
    min_ok: float | None = None
    aliases: tuple[str, ...] = ()

    def healthy(self, value: float | None) -> bool:
        if value is None:
            return True
        if self.max_ok is not None and value > self.max_ok:
            return False
        return not (self.min_ok is not None and value < self.min_ok)


SEED_METRICS: tuple[SeedMetric, ...] = (
    SeedMetric("scheduler.queue_depth", "vllm:num_requests_waiting", "gauge",
               "requests admitted but waiting to run"),
    SeedMetric("scheduler.running", "vllm:num_requests_running", "gauge",
               "requests holding KV blocks"),
    SeedMetric("scheduler.swapped", "vllm:num_requests_swapped", "gauge",
               "requests preempted by swap to CPU"),
    SeedMetric("input_queue.size", "llmtower:input_queue_size", "gauge",
               "requests received by the engine, not yet taken in by the scheduler"),
    SeedMetric("scheduler.preempt_count", "vllm:num_preemptions_total", "counter",
               "preemptions (recompute or swap)"),
    SeedMetric("scheduler.swap_outs", "llmtower:swap_outs_total", "counter",
               "requests swapped out to CPU"),
    SeedMetric("scheduler.swap_ins", "llmtower:swap_ins_total", "counter",
               "requests swapped back in"),
    SeedMetric("scheduler.step_delay", "llmtower:scheduler_step_delay_seconds", "histogram",
               "schedule() alone, per step (seconds)", max_ok=0.050,
               aliases=("scheduler/step_delay_ms", "scheduler.step_delay_ms")),
    SeedMetric("scheduler.step_time", "llmtower:scheduler_step_seconds", "histogram",
               "a whole engine step (seconds)"),
    SeedMetric("batch.utilization", "llmtower:batch_utilization", "gauge",
               "scheduled tokens / token budget", aggregate="mean", min_ok=0.7,
               aliases=("batch/utilization", "scheduler.batch_utilization")),
    SeedMetric("kv_cache.usage", "vllm:kv_cache_usage_perc", "gauge",
               "fraction of KV blocks in use", aggregate="mean"),
    SeedMetric("kv_cache.free_blocks", "llmtower:kv_cache_free_blocks", "gauge",
               "free KV blocks"),
    SeedMetric("kv_cache.fragmentation_ratio", "llmtower:kv_cache_fragmentation_ratio",
               "gauge", "internal: unused slots of allocated blocks", {"kind": "internal"},
               aggregate="mean", max_ok=0.2, aliases=("kv_cache/fragmentation_ratio",)),
    SeedMetric("kv_cache.external_fragmentation", "llmtower:kv_cache_fragmentation_ratio",
               "gauge", "1 - largest free run / free blocks", {"kind": "external"},
               aggregate="mean"),
    SeedMetric("kv_cache.evictions", "llmtower:prefix_cache_evictions_total", "counter",
               "prefix-cache blocks evicted"),
    SeedMetric("prefix_cache.hit_rate", "vllm:prefix_cache_hits_total", "ratio",
               "prompt tokens found in the prefix cache / looked up",
               denominator="vllm:prefix_cache_queries_total"),
    SeedMetric("requests.queue_time_p99", "llmtower:request_queue_time_p99_seconds", "gauge",
               "p99 queue time over the last 60 s (seconds)", aggregate="max", max_ok=1.0,
               aliases=("requests/queue_time_p99",)),
    SeedMetric("requests.ttft", "vllm:time_to_first_token_seconds", "histogram",
               "time to first token (seconds)"),
    SeedMetric("requests.itl", "vllm:inter_token_latency_seconds", "histogram",
               "inter-token latency (seconds)"),
    SeedMetric("requests.finished", "vllm:request_success_total", "counter",
               "finished requests (every finish reason)"),
    SeedMetric("requests.rejected", "vllm:admission_rejections_total", "counter",
               "requests refused before they ran"),
    SeedMetric("throughput.prompt_tokens", "vllm:prompt_tokens_total", "counter",
               "prompt tokens"),
    SeedMetric("throughput.generation_tokens", "vllm:generation_tokens_total", "counter",
               "generated tokens"),
)

BY_NAME: dict[str, SeedMetric] = {}
for _m in SEED_METRICS:
    for _name in (_m.dotted, *_m.aliases):
        BY_NAME[_name] = _m


def resolve(name: str) -> SeedMetric:
    """A dotted name, one of its aliases, or the Prometheus name of a series in the table."""
    if name in BY_NAME:
        return BY_NAME[name]
    for m in SEED_METRICS:
        if name == m.prom and not m.labels:
            return m
    known = ", ".join(m.dotted for m in SEED_METRICS)
    raise ValueError(f"unknown metric {name!r}; known: {known}")
