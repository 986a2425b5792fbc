"""The memory-under-pressure families: degradation level, actions by kind, relocator moves and
pinned blocks, fed from the engine's stats snapshots (counters only ever add the increase)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from llmtower.core.outputs import SchedulerStats
from llmtower.metrics.prometheus import ServingMetrics


def samples(m: ServingMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                      if k not in ("model_name", "engine"))))] = s.value
    return out


def test_degradation_and_relocator_families():
    m = ServingMetrics("tiny")
    m.record_scheduler_stats(SchedulerStats(degradation_level=3, num_block_moves_total=40,
                                            num_pinned_blocks=9,
                                            degradation_actions={"shrink": 2, "refuse": 0}))
    m.record_scheduler_stats(SchedulerStats(degradation_level=4, num_block_moves_total=50,
                                            num_pinned_blocks=9,
                                            degradation_actions={"shrink": 3, "refuse": 5}))
    got = samples(m)
    assert got[("llmtower:degradation_level", ())] == 4
    assert got[("llmtower:degradation_actions_total", (("action", "shrink"),))] == 3
    assert got[("llmtower:degradation_actions_total", (("action", "refuse"),))] == 5
    assert got[("llmtower:kv_block_moves_total", ())] == 50
    assert got[("llmtower:kv_cache_pinned_blocks", ())] == 9
