"""ServingMetrics: engine snapshots and finished requests become vLLM-named Prometheus series,
one set per data-parallel engine (label ``engine``)."""
from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmtower.core.outputs import RequestMetrics, SchedulerStats
from llmtower.metrics.prometheus import RequestParams, ServingMetrics
from llmtower.metrics.sliding_quantile import SlidingWindowQuantile
from llmtower.metrics.stats_logger import LoggingStatLogger


def _samples(m: ServingMetrics, engine: str | None = "0") -> dict[tuple[str, tuple], float]:
    """Samples of model "m" (of one engine unless ``engine`` is None), engine label dropped."""
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            if s.labels.get("model_name") != "m":
                continue
            if engine is not None and s.labels.get("engine", engine) != engine:
                continue
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "engine")))
            out[(s.name, labels)] = s.value
    return out


def test_cumulative_engine_totals_become_counter_increments():
    m = ServingMetrics("m")
    m.record_scheduler_stats(SchedulerStats(prefix_cache_queries=100, prefix_cache_hits=40,
                                            num_preemptions_total=2, num_running_reqs=3,
                                            kv_cache_usage=0.25, token_budget=100,
                                            num_evictions=4, num_swap_outs_total=2,
                                            num_swap_ins_total=1,
                                            step_num_tokens=[50, 30], step_seconds=[0.01, 0.02],
                                            step_schedule_seconds=[0.0001, 0.0002, 0.06]))
    m.record_scheduler_stats(SchedulerStats(prefix_cache_queries=150, prefix_cache_hits=40,
                                            num_preemptions_total=3, token_budget=100,
                                            num_evictions=5, num_swap_outs_total=2,
                                            num_swap_ins_total=2, num_free_blocks=77,
                                            input_queue_size=4, fragmentation=0.25,
                                            external_fragmentation=0.5, num_cached_blocks=9,
                                            step_num_tokens=[10], step_seconds=[0.005]))
    s = _samples(m)
    assert s[("vllm:prefix_cache_queries_total", ())] == 150
    assert s[("vllm:prefix_cache_hits_total", ())] == 40
    assert s[("vllm:num_preemptions_total", ())] == 3
    assert s[("llmtower:prefix_cache_evictions_total", ())] == 5
    assert s[("llmtower:swap_outs_total", ())] == 2
    assert s[("llmtower:swap_ins_total", ())] == 2
    assert s[("vllm:num_requests_running", ())] == 0  # the latest snapshot wins
    assert s[("vllm:kv_cache_usage_perc", ())] == 0.0
    assert s[("llmtower:kv_cache_free_blocks", ())] == 77
    assert s[("llmtower:input_queue_size", ())] == 4
    assert s[("llmtower:prefix_cache_blocks", ())] == 9
    assert s[("llmtower:kv_cache_fragmentation_ratio", (("kind", "internal"),))] == 0.25
    assert s[("llmtower:kv_cache_fragmentation_ratio", (("kind", "external"),))] == 0.5
    assert s[("vllm:iteration_tokens_total_count", ())] == 3
    assert s[("vllm:iteration_tokens_total_sum", ())] == 90
    assert s[("llmtower:scheduler_step_seconds_count", ())] == 3
    # The step delay (schedule() alone) has its own histogram: 2 of 3 steps under 1 ms.
    assert s[("llmtower:scheduler_step_delay_seconds_count", ())] == 3
    assert s[("llmtower:scheduler_step_delay_seconds_bucket", (("le", "0.001"),))] == 2
    assert s[("llmtower:batch_utilization", ())] == 0.1


def test_finished_requests_feed_the_latency_and_size_histograms():
    m = ServingMetrics("m")
    m.record_prompt_tokens(12)
    m.record_generation_tokens(5)
    m.record_finished("stop")
    m.record_finished("abort")
    m.record_request_timings(RequestMetrics(queue_time=0.1, ttft=0.2, prefill_time=0.1,
                                            decode_time=0.5, e2e_latency=0.7,
                                            num_prompt_tokens=12, num_cached_tokens=8,
                                            num_generation_tokens=6, num_preemptions=1),
                             params=RequestParams(n=2, max_tokens=4,
                                                  max_num_generation_tokens=4))
    m.record_rejection("queue_full")
    s = _samples(m)
    assert s[("vllm:prompt_tokens_total", ())] == 12
    assert s[("vllm:generation_tokens_total", ())] == 5
    assert s[("vllm:request_success_total", (("finished_reason", "stop"),))] == 1
    assert s[("vllm:request_success_total", (("finished_reason", "abort"),))] == 1
    assert s[("vllm:time_to_first_token_seconds_sum", ())] == 0.2
    assert s[("vllm:e2e_request_latency_seconds_count", ())] == 1
    assert s[("vllm:admission_rejections_total", (("reason", "queue_full"),))] == 1
    assert s[("vllm:request_inference_time_seconds_sum", ())] == pytest.approx(0.6)
    # TPOT over the longest sample: 0.5 s for its 3 tokens after the first.
    assert s[("vllm:request_time_per_output_token_seconds_sum", ())] == pytest.approx(0.5 / 3)
    assert s[("vllm:request_prompt_tokens_sum", ())] == 12
    assert s[("vllm:request_generation_tokens_sum", ())] == 6
    assert s[("vllm:request_max_num_generation_tokens_sum", ())] == 4
    assert s[("vllm:request_prefill_kv_computed_tokens_sum", ())] == 4
    assert s[("vllm:prompt_tokens_cached_total", ())] == 8
    assert s[("vllm:request_params_n_sum", ())] == 2
    assert s[("vllm:request_params_max_tokens_sum", ())] == 4
    assert s[("vllm:request_num_preemptions_sum", ())] == 1
    assert s[("llmtower:request_queue_time_p99_seconds", ())] == pytest.approx(0.1)


def test_every_finish_reason_kind_and_rejection_reason_is_exported_from_the_start():
    s = _samples(ServingMetrics("m"))
    for reason in ("stop", "length", "abort"):
        assert s[("vllm:request_success_total", (("finished_reason", reason),))] == 0
    for kind in ("internal", "external"):
        assert s[("llmtower:kv_cache_fragmentation_ratio", (("kind", kind),))] == 0
    for reason in ("admission", "queue_full", "invalid", "timeout"):
        assert s[("vllm:admission_rejections_total", (("reason", reason),))] == 0


def test_each_data_parallel_engine_has_its_own_series():
    m = ServingMetrics("m", num_engines=2)
    m.record_scheduler_stats(SchedulerStats(num_waiting_reqs=5, num_preemptions_total=2), 0)
    m.record_scheduler_stats(SchedulerStats(num_waiting_reqs=1, num_preemptions_total=7), 1)
    m.record_finished("length", engine=1)
    e0, e1 = _samples(m, "0"), _samples(m, "1")
    assert e0[("vllm:num_requests_waiting", ())] == 5
    assert e1[("vllm:num_requests_waiting", ())] == 1
    # Each engine's cumulative totals are tracked apart: no negative or doubled increments.
    assert e0[("vllm:num_preemptions_total", ())] == 2
    assert e1[("vllm:num_preemptions_total", ())] == 7
    assert e0[("vllm:request_success_total", (("finished_reason", "length"),))] == 0
    assert e1[("vllm:request_success_total", (("finished_reason", "length"),))] == 1


def test_cache_config_info_and_the_process_family():
    m = ServingMetrics("m", num_engines=2)
    m.record_cache_config({"block_size": 16, "num_gpu_blocks": 100,
                           "enable_prefix_caching": True})
    infos = [s for f in text_string_to_metric_families(m.render().decode())
             if f.name == "vllm:cache_config_info" for s in f.samples]
    assert {s.labels["engine"] for s in infos} == {"0", "1"}
    assert all(s.value == 1 and s.labels["block_size"] == "16" for s in infos)
    names = {f.name for f in text_string_to_metric_families(m.render().decode())}
    assert "process_cpu_seconds" in names and "python_gc_objects_collected" in names


def test_two_servers_in_one_process_keep_separate_counters():
    a, b = ServingMetrics("m"), ServingMetrics("m")
    a.record_generation_tokens(3)
    assert _samples(b)[("vllm:generation_tokens_total", ())] == 0


def test_queue_time_p99_covers_only_the_last_window():
    now = [0.0]
    w = SlidingWindowQuantile(0.99, window_s=60, clock=lambda: now[0])
    assert w.value() == 0.0
    for v in range(1, 101):  # 1..100 s at t=0
        w.observe(float(v))
    assert w.value() == 99.0
    now[0] = 30.0
    w.observe(0.5)
    now[0] = 61.0  # the first hundred have left the window
    assert w.value() == 0.5
    with pytest.raises(ValueError):
        SlidingWindowQuantile(1.5)


def test_stats_logger_writes_a_line_per_interval_while_busy(caplog):
    log = LoggingStatLogger(interval_s=0.0)
    log.record_tokens(100, 20)
    with caplog.at_level(logging.INFO, logger="llmtower.stats"):
        log.maybe_log(SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5))
        log.maybe_log(SchedulerStats())  # idle and nothing new: silent
    assert len(caplog.records) == 1
    assert "running: 2 reqs" in caplog.text and "KV cache usage: 50.0%" in caplog.text
