"""Prometheus metrics of one served model, under vLLM's names so existing dashboards work.

Two sources feed them: the engine's ``SchedulerStats`` snapshots (queue lengths, KV-cache
usage, cumulative cache/preemption counters, per-step tokens and seconds), and the API
process's own view of each request (tokens as they stream, inter-token gaps, and the engine's
``RequestMetrics`` when it finishes). Each server gets its own ``CollectorRegistry``, so two
servers (or tests) in one process never share counters.
"""
from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from llmtower.core.outputs import RequestMetrics, SchedulerStats

# The *_created companion series double the output and no dashboard reads them.
prometheus_client.disable_created_metrics()

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_TIME_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                        20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
STEP_SECONDS_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                        2.5, 5.0]


class ServingMetrics:
    """Owns the Prometheus registry of one served model and turns engine snapshots and
    finished requests into metric updates. Every metric carries the ``model_name`` label."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        reg, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: list) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running",
                                          "Requests holding KV blocks and being stepped.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting",
                                          "Requests admitted but waiting to run.")
        self.num_requests_swapped = gauge("vllm:num_requests_swapped",
                                          "Requests preempted by swap to CPU memory.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc",
                                    "KV-cache usage as a fraction (1 = every block in use).")
        self.fragmentation = gauge("llmtower:kv_cache_fragmentation_ratio",
                                   "Allocated KV slots holding no token / allocated slots.")
        self.batch_utilization = gauge("llmtower:batch_utilization",
                                       "Scheduled tokens / token budget, mean over recent steps.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("vllm:num_preemptions_total",
                                       "Requests preempted (recompute or swap).")
        self.prompt_tokens = counter("vllm:prompt_tokens_total", "Prefilled prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens_total", "Generated tokens.")
        self.request_success = Counter(
            "vllm:request_success_total", "Finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=reg)
        self.admission_rejections = Counter(
            "vllm:admission_rejections", "Requests refused before they ran, by reason.",
            ["model_name", "reason"], registry=reg)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between two outputs of a request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Arrival to finish of a request.", REQUEST_TIME_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Time a request waited before it was first scheduled.",
                                    REQUEST_TIME_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "First scheduled to first token.", REQUEST_TIME_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "First token to last token.", REQUEST_TIME_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Tokens scheduled in one engine step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.step_seconds = histogram("llmtower:scheduler_step_seconds",
                                      "Wall time of one engine step (schedule, execute, update).",
                                      STEP_SECONDS_BUCKETS)
        # Engine totals are cumulative; Prometheus counters take increments.
        self._last_totals = (0, 0, 0)
        self.last_stats: SchedulerStats | None = None

    # ------------------------------------------------------------------ engine snapshots
    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.last_stats = stats
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.num_requests_swapped.set(stats.num_swapped_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.fragmentation.set(stats.fragmentation)
        totals = (stats.prefix_cache_queries, stats.prefix_cache_hits,
                  stats.num_preemptions_total)
        for metric, new, old in zip((self.prefix_cache_queries, self.prefix_cache_hits,
                                     self.num_preemptions), totals, self._last_totals):
            if new > old:
                metric.inc(new - old)
        self._last_totals = totals
        for n in stats.step_num_tokens:
            self.iteration_tokens.observe(n)
        for s in stats.step_seconds:
            self.step_seconds.observe(s)
        if stats.token_budget:
            steps = stats.step_num_tokens or [stats.last_step_num_tokens]
            self.batch_utilization.set(sum(steps) / len(steps) / stats.token_budget)

    # ------------------------------------------------------------------ requests
    def record_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.inc(n)

    def record_generation_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def record_inter_token_latency(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def record_finished(self, finish_reason: str) -> None:
        """One sample (sequence) ended: ``stop``, ``length`` or ``abort``."""
        self.request_success.labels(self.model_name, finish_reason).inc()

    def record_request_timings(self, metrics: RequestMetrics) -> None:
        """Where one finished request spent its time (once per request, whatever its n)."""
        if metrics.ttft:
            self.ttft.observe(metrics.ttft)
        self.e2e.observe(metrics.e2e_latency)
        self.queue_time.observe(metrics.queue_time)
        self.prefill_time.observe(metrics.prefill_time)
        self.decode_time.observe(metrics.decode_time)

    def record_rejection(self, reason: str) -> None:
        self.admission_rejections.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return prometheus_client.generate_latest(self.registry)
