"""DPEngineCoreClient's own decisions, without processes: where requests go, what an abort
releases, how the engines' stats add up."""
from __future__ import annotations

import pytest

from llmtower.core.outputs import SchedulerStats
from llmtower.engine.args import EngineArgs
from llmtower.engine.dp_client import DPEngineCoreClient, engine_threads, merge_stats


def client(n: int = 3) -> DPEngineCoreClient:
    return DPEngineCoreClient(EngineArgs(model="fake", data_parallel_size=n))


def test_requests_go_to_the_least_loaded_engine_in_turn():
    c = client(3)
    assert [c._assign(f"r{i}") for i in range(6)] == [0, 1, 2, 0, 1, 2]  # ties: in turn
    c._release("r1")
    c._release("r4")  # engine 1 is now empty
    assert c._assign("x") == 1
    assert c.in_flight == [2, 1, 2]


def test_aborts_follow_the_request_and_release_it_once():
    c = client(2)
    for rid in ("a", "b", "c"):
        c._assign(rid)
    assert c._by_engine(["a", "b", "c", "unknown"]) == {0: ["a", "c"], 1: ["b"]}
    assert c.in_flight == [0, 0]
    assert c._by_engine(["a"]) == {}  # already released: nothing to abort twice


def test_merged_stats_add_up_and_keep_only_the_latest_engines_steps():
    a = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, num_free_blocks=10,
                       num_total_blocks=100, num_preemptions_total=2, num_steps=50,
                       fragmentation=0.2, step_num_tokens=[64, 64], token_budget=2048)
    b = SchedulerStats(num_running_reqs=5, num_free_blocks=40, num_total_blocks=100,
                       num_preemptions_total=1, num_steps=70, fragmentation=0.4,
                       step_num_tokens=[128], token_budget=2048)
    m = merge_stats([a, b], b)
    assert (m.num_running_reqs, m.num_waiting_reqs, m.num_steps) == (8, 1, 120)
    assert m.num_total_blocks == 200 and m.num_free_blocks == 50
    assert m.kv_cache_usage == pytest.approx(150 / 200)
    assert m.num_preemptions_total == 3 and m.fragmentation == pytest.approx(0.3)
    assert m.step_num_tokens == [128]  # b's steps only: a's were counted when a's snapshot came


def test_threads_are_shared_out_unless_given(monkeypatch):
    monkeypatch.setattr("llmtower.executor.cpu_threads.available_cpus", lambda: 8)
    assert engine_threads(EngineArgs(model="fake", data_parallel_size=2)) == 4
    assert engine_threads(EngineArgs(model="fake", data_parallel_size=16)) == 1
    assert engine_threads(EngineArgs(model="fake", data_parallel_size=2, num_threads=3)) == 3
    assert [x.engine_args.num_threads for x in client(2).clients] == [4, 4]


def test_one_engine_is_not_data_parallel():
    with pytest.raises(ValueError, match="EngineCoreClient"):
        DPEngineCoreClient(EngineArgs(model="fake", data_parallel_size=1))
