"""ServingMetrics: engine snapshots and finished requests become vLLM-named Prometheus series."""
from __future__ import annotations

import logging

from prometheus_client.parser import text_string_to_metric_families

from llmtower.core.outputs import RequestMetrics, SchedulerStats
from llmtower.metrics.prometheus import ServingMetrics
from llmtower.metrics.stats_logger import LoggingStatLogger


def _samples(m: ServingMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            assert s.labels["model_name"] == "m"
            out[(s.name, labels)] = s.value
    return out


def test_cumulative_engine_totals_become_counter_increments():
    m = ServingMetrics("m")
    m.record_scheduler_stats(SchedulerStats(prefix_cache_queries=100, prefix_cache_hits=40,
                                            num_preemptions_total=2, num_running_reqs=3,
                                            kv_cache_usage=0.25, token_budget=100,
                                            step_num_tokens=[50, 30], step_seconds=[0.01, 0.02]))
    m.record_scheduler_stats(SchedulerStats(prefix_cache_queries=150, prefix_cache_hits=40,
                                            num_preemptions_total=3, token_budget=100,
                                            step_num_tokens=[10], step_seconds=[0.005]))
    s = _samples(m)
    assert s[("vllm:prefix_cache_queries_total", ())] == 150
    assert s[("vllm:prefix_cache_hits_total", ())] == 40
    assert s[("vllm:num_preemptions_total", ())] == 3
    assert s[("vllm:num_requests_running", ())] == 0  # the latest snapshot wins
    assert s[("vllm:kv_cache_usage_perc", ())] == 0.0
    assert s[("vllm:iteration_tokens_total_count", ())] == 3
    assert s[("vllm:iteration_tokens_total_sum", ())] == 90
    assert s[("llmtower:scheduler_step_seconds_count", ())] == 3
    assert s[("llmtower:batch_utilization", ())] == 0.1


def test_finished_requests_feed_the_latency_histograms():
    m = ServingMetrics("m")
    m.record_prompt_tokens(12)
    m.record_generation_tokens(5)
    m.record_finished("stop")
    m.record_finished("abort")
    m.record_request_timings(RequestMetrics(queue_time=0.1, ttft=0.2, prefill_time=0.1,
                                            decode_time=0.5, e2e_latency=0.7))
    m.record_rejection("queue_full")
    s = _samples(m)
    assert s[("vllm:prompt_tokens_total", ())] == 12
    assert s[("vllm:generation_tokens_total", ())] == 5
    assert s[("vllm:request_success_total", (("finished_reason", "stop"),))] == 1
    assert s[("vllm:request_success_total", (("finished_reason", "abort"),))] == 1
    assert s[("vllm:time_to_first_token_seconds_sum", ())] == 0.2
    assert s[("vllm:e2e_request_latency_seconds_count", ())] == 1
    assert s[("vllm:admission_rejections_total", (("reason", "queue_full"),))] == 1


def test_two_servers_in_one_process_keep_separate_counters():
    a, b = ServingMetrics("m"), ServingMetrics("m")
    a.record_generation_tokens(3)
    assert _samples(b)[("vllm:generation_tokens_total", ())] == 0


def test_stats_logger_writes_a_line_per_interval_while_busy(caplog):
    log = LoggingStatLogger(interval_s=0.0)
    log.record_tokens(100, 20)
    with caplog.at_level(logging.INFO, logger="llmtower.stats"):
        log.maybe_log(SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5))
        log.maybe_log(SchedulerStats())  # idle and nothing new: silent
    assert len(caplog.records) == 1
    assert "running: 2 reqs" in caplog.text and "KV cache usage: 50.0%" in caplog.text
