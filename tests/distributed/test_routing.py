"""The head's router (also the simulator's 'coordinator' balancer) and the topology checks."""
from __future__ import annotations

import pytest

from llmtower.distributed.routing import EngineLoad, Router, prefix_keys
from llmtower.distributed.topology import DPTopology
from llmtower.engine.args import EngineArgs


def test_least_loaded_by_real_queues_and_kv_usage_ties_in_turn():
    r = Router(block_size=4, prefix_aware=False)
    idle = [EngineLoad() for _ in range(3)]
    assert [r.choose(idle) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    # Engine 0 holds nothing from this server but has a long queue from elsewhere.
    loads = [EngineLoad(in_flight=0, waiting=9), EngineLoad(in_flight=2), EngineLoad(in_flight=3)]
    assert r.choose(loads) == 1
    # A nearly full KV cache weighs like queued requests.
    loads = [EngineLoad(in_flight=1, kv_usage=0.95), EngineLoad(in_flight=3)]
    assert r.choose(loads) == 1


def test_dead_engines_are_never_chosen_and_none_alive_is_an_error():
    r = Router(block_size=4)
    loads = [EngineLoad(alive=False), EngineLoad(in_flight=50)]
    assert {r.choose(loads) for _ in range(5)} == {1}
    with pytest.raises(ValueError, match="no data-parallel engine is alive"):
        r.choose([EngineLoad(alive=False)])


def test_prefix_affinity_within_slack_and_not_onto_an_overloaded_engine():
    r = Router(block_size=4, slack=2)
    system = list(range(100, 116))  # four full blocks
    loads = [EngineLoad(), EngineLoad()]
    first = r.choose(loads, system + [1, 2, 3])
    loads[first].in_flight = 2  # busier, but within the slack: affinity holds
    assert r.choose(loads, system + [7, 8, 9]) == first
    assert r.num_affinity_hits == 1
    loads[first].in_flight = 9  # overloaded: the request goes elsewhere after all
    assert r.choose(loads, system + [4, 4, 4]) == 1 - first
    # The longest shared prefix wins: a prompt sharing only the first block follows it too.
    r2 = Router(block_size=4, slack=0)
    a = r2.choose([EngineLoad(), EngineLoad()], [1, 2, 3, 4, 5, 6, 7, 8])
    b = r2.choose([EngineLoad(), EngineLoad()], [1, 2, 3, 4, 9, 9, 9, 9])
    assert a == b


def test_affinity_table_is_bounded_and_a_lost_engine_is_forgotten():
    r = Router(block_size=2, table_size=10)
    for i in range(50):
        r.choose([EngineLoad(), EngineLoad()], [i, i, i, i])
    assert len(r._table) == 10
    r.forget_engine(0)
    assert 0 not in r._table.values()


def test_prefix_keys_chain_over_whole_blocks_only():
    k1 = prefix_keys([1, 2, 3, 4, 5], block_size=2, max_blocks=8)
    k2 = prefix_keys([1, 2, 3, 9], block_size=2, max_blocks=8)
    assert len(k1) == 2 and k1[0] == k2[0] and k1[1] != k2[1]
    assert prefix_keys([1], 2, 8) == []


def test_topology_ports_and_refusals():
    t = DPTopology(size=4, size_local=2, address="10.0.0.1", rpc_port=20000)
    assert t.multi_host and list(t.local_ranks) == [0, 1] and t.remote_ranks == [2, 3]
    assert t.input_address(3) == "tcp://10.0.0.1:20007"
    assert t.output_address(3) == "tcp://10.0.0.1:20008"
    with pytest.raises(ValueError, match="--headless"):
        DPTopology(size=4, size_local=2, start_rank=2)  # the head runs ranks from 0
    with pytest.raises(ValueError, match="start-rank R with R >= "):
        DPTopology(size=4, size_local=2, start_rank=0, headless=True)
    with pytest.raises(ValueError, match="beyond data_parallel_size"):
        DPTopology(size=4, size_local=3, start_rank=2, headless=True)
    with pytest.raises(ValueError, match="65535"):
        DPTopology(size=4, rpc_port=65530)
    with pytest.raises(ValueError, match="data_parallel_size_local"):
        EngineArgs(model="fake", data_parallel_size=2, data_parallel_size_local=3)
    with pytest.raises(ValueError, match="dp_sync_interval"):
        EngineArgs(model="fake", data_parallel_size=2, dp_sync_interval=0)
