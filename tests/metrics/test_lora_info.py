"""vllm:lora_requests_info: vLLM's labels (max_lora, waiting_lora_adapters,
running_lora_adapters), the snapshot's time as value, one series per engine."""
from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.outputs import SchedulerStats
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from llmtower.core.sched.scheduler import Scheduler
from llmtower.lora.request import LoRARequest
from llmtower.metrics.prometheus import ServingMetrics


def _lora_samples(m: ServingMetrics) -> list:
    return [s for f in text_string_to_metric_families(m.render().decode())
            for s in f.samples if s.name == "vllm:lora_requests_info"]


def test_series_follows_the_latest_snapshot():
    m = ServingMetrics("m")
    m.record_scheduler_stats(SchedulerStats())  # LoRA off: no series
    assert _lora_samples(m) == []
    before = time.time()
    m.record_scheduler_stats(SchedulerStats(max_lora=2, running_lora_adapters=["a", "b"],
                                            waiting_lora_adapters=["c"]))
    (s,) = _lora_samples(m)
    assert s.labels == {"max_lora": "2", "running_lora_adapters": "a,b",
                        "waiting_lora_adapters": "c", "engine": "0"}
    assert s.value >= before - 1
    m.record_scheduler_stats(SchedulerStats(max_lora=2, running_lora_adapters=["c"]))
    (s,) = _lora_samples(m)  # the old label set is gone
    assert s.labels["running_lora_adapters"] == "c" and s.labels["waiting_lora_adapters"] == ""


def test_scheduler_stats_name_running_and_waiting_adapters():
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32,
                                  max_loras=1), CacheConfig(block_size=4, num_blocks=32))
    for rid, (name, i) in enumerate([("a", 1), ("b", 2), ("a", 1)]):
        s.add_request(Request(str(rid), [1, 2, 3], SamplingParams(max_tokens=4),
                              lora_request=LoRARequest(name, i, "/x")))
    s.schedule()
    stats = s.get_stats()
    assert stats.max_lora == 1
    assert stats.running_lora_adapters == ["a"] and stats.waiting_lora_adapters == ["b"]
    off = Scheduler(SchedulerConfig(max_model_len=32), CacheConfig(block_size=4, num_blocks=8))
    assert off.get_stats().max_lora == 0
