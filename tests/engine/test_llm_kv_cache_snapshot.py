"""`LLM.kv_cache_snapshot()`: the offline path of `llmtower diag memory`, while a stream holds
blocks and after it has finished."""
from __future__ import annotations

from llmtower.core.sampling_params import SamplingParams


def test_a_stream_in_flight_shows_in_the_snapshot_and_leaves_nothing_behind(fake_llm):
    stream = fake_llm.stream("The quick brown fox jumps over the lazy dog",
                             SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    next(stream)
    snap = fake_llm.kv_cache_snapshot()
    assert len(snap.requests) == 1 and snap.requests[0].status == "running"
    held = snap.requests[0].num_blocks
    assert held > 0 and snap.num_used + snap.num_shared == held
    assert snap.block_states.count("u") == held
    for _ in stream:
        pass
    after = fake_llm.kv_cache_snapshot()
    assert after.requests == [] and after.num_used == after.num_shared == 0
    assert after.num_free + after.num_cached_free == after.num_blocks
