"""The offline LLM's memory operations on the tiny model: ``preload`` (prompts into the
prefix cache, pinned or not, bad prompts reported by index), ``unpin`` and ``defragment``."""
from __future__ import annotations

import pytest

from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.llm import LLM

BS = 4
SYSTEM = list(range(10, 10 + 40))  # 40 tokens: 10 full blocks, of which 9 are reusable


def make_llm(model_dir, **kw) -> LLM:
    args = dict(num_threads=1, block_size=BS, max_model_len=128, num_gpu_blocks=64, seed=0)
    args.update(kw)
    return LLM(str(model_dir), **args)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


def pool_is_idle(llm: LLM) -> bool:
    kv = llm.engine_core.scheduler.kv
    return kv.pool.num_free_blocks == kv.pool.num_blocks - len(kv.pinned)


def test_preloaded_prompt_is_a_prefix_hit_for_the_first_request(llm):
    llm.engine_core.scheduler.kv.pool.reset_prefix_cache()
    st = llm.preload([SYSTEM])
    assert st.finished and st.num_done == 1 and st.num_cached_blocks == 9 and not st.errors
    assert pool_is_idle(llm)  # nothing generated, nothing held
    (out,) = llm.generate([SYSTEM + [7, 8, 9]], greedy(4), use_tqdm=False)
    assert out.num_cached_tokens == 40  # every full block of the system prompt was cached
    assert len(out.outputs[0].token_ids) == 4


def test_preload_reports_bad_prompts_by_index_and_loads_the_others(llm):
    too_long = list(range(3, 3 + 200))  # over max_model_len=128
    st = llm.preload([SYSTEM[:12], too_long, [5] * 9])
    assert st.num_done == 2 and st.num_failed == 1
    assert [e.index for e in st.errors] == [1] and "max_model_len" in st.errors[0].message
    assert pool_is_idle(llm)


def test_pinned_prefix_survives_eviction_pressure_until_unpinned(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_gpu_blocks=24, max_pinned_blocks=10)
    kv = llm.engine_core.scheduler.kv
    st = llm.preload([SYSTEM], pin=True)
    assert st.num_pinned_blocks == 9 and st.total_pinned_blocks == 9
    assert st.max_pinned_blocks == 10
    pinned_hashes = [b.block_hash for b in kv.pinned.blocks]
    # Other prompts fill the pool many times over: every unpinned cached block is evicted.
    others = [[100 + i] * 40 for i in range(6)]
    llm.generate(others, greedy(8), use_tqdm=False)
    assert kv.pool.num_evictions > 0
    assert all(h in kv.pool.cached for h in pinned_hashes)
    (out,) = llm.generate([SYSTEM + [1, 2]], greedy(2), use_tqdm=False)
    assert out.num_cached_tokens == 36
    # A second preload of the same prompt pins nothing new; the budget caps a third prompt.
    st = llm.preload([SYSTEM, list(range(300, 340))], pin=True)
    assert st.num_pinned_blocks == 1 and st.total_pinned_blocks == 10
    assert llm.unpin() == 10
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and not kv.pinned.blocks
    llm.generate(others, greedy(8), use_tqdm=False)
    assert not all(h in kv.pool.cached for h in pinned_hashes)  # evictable again


def test_defragment_packs_the_cached_blocks_of_an_idle_engine(llm):
    llm.generate([[20 + i] * (9 + 5 * i) for i in range(6)], greedy(6), use_tqdm=False)
    res = llm.defragment()
    assert res.free_fragmentation_after == 0.0 and res.fragmentation_after == 0.0
    assert res.num_moves >= 0 and res.fragmentation_before >= res.fragmentation_after
    again = llm.defragment()
    assert again.num_moves == 0  # already packed
    # The moved prefix blocks still serve hits with the right K/V: same greedy tokens.
    prompt = [20] * 9 + [1]
    (a,) = llm.generate([prompt], greedy(6), use_tqdm=False)
    assert a.num_cached_tokens == 8
    llm.engine_core.scheduler.kv.pool.reset_prefix_cache()
    (b,) = llm.generate([prompt], greedy(6), use_tqdm=False)
    assert b.num_cached_tokens == 0 and a.outputs[0].token_ids == b.outputs[0].token_ids


def test_preload_refused_without_prefix_caching(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching is disabled"):
        llm.preload([SYSTEM])
