"""Greedy outputs with KV blocks moved every step (and a full defragmentation between steps)
are identical to a run that never moves a block, on the real models, with prefix caching,
swap preemption and chunked prefill all at work."""
from __future__ import annotations

import pytest

from exactness_helpers import add_greedy, make_engine, random_prompts, run_all

MAX_TOKENS = 20
SHARED = random_prompts(1, 24, 24, seed=2)[0]
PREFIXED = random_prompts(12, 1, 24, seed=3, prefix=SHARED)
# A tight pool (swap preemptions), small chunks, shared prefixes.
PRESSURE = dict(num_gpu_blocks=44, preemption_mode="swap", max_num_batched_tokens=24,
                long_prefill_token_threshold=12, max_num_partial_prefills=2)


def run(model_dir, on_demand: bool = False, **kw) -> tuple[dict[str, list[int]], object]:
    core = make_engine(model_dir, **PRESSURE, **kw)
    add_greedy(core, PREFIXED, MAX_TOKENS)
    if not on_demand:
        return run_all(core), core
    out: dict[str, list[int]] = {}
    moved = 0
    while core.has_unfinished_requests():
        moved += core.defragment().num_moves  # between every two steps
        for o in core.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    core.num_defrag_moves = moved
    return out, core


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    never, core = run(model_dir)
    assert core.scheduler.num_swap_outs > 0 and core.scheduler.kv.prefix_cache_hits > 0
    return model_dir, never


@pytest.mark.parametrize("backend", ["c", "torch"])
def test_moving_blocks_every_step_changes_no_token(model, backend):
    model_dir, never = model
    # Threshold 0: any block out of place is moved, a few per step (spread over steps).
    out, core = run(model_dir, kv_allocator="relocator", fragmentation_threshold=0.0,
                    max_block_moves_per_step=6, attention_backend=backend)
    assert core.scheduler.relocator.num_moves_total > 20
    assert out == never


def test_full_defragmentation_between_every_step_changes_no_token(model):
    model_dir, never = model
    out, core = run(model_dir, on_demand=True)
    assert core.num_defrag_moves > 20
    assert out == never
