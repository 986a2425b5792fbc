"""The CPU executor driven by hand-made SchedulerOutputs: KV block moves, persistent
per-request state, mixed batches, clear errors; and the engine factory's sizing."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from llmtower.core.config import CacheConfig
from llmtower.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.factory import create_engine_core, kv_cache_blocks, resolve_max_model_len
from llmtower.executor import model_runner
from llmtower.executor.cpu_executor import CPUExecutor
from llmtower.executor.kv_cache import KVCache, bytes_per_block
from llmtower.models.loader import load_model_config, load_state_dict

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
PROMPT = [5, 9, 100, 200, 300, 17, 18, 19, 20, 21]  # 10 tokens: blocks of 4, 4, 2


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model_config(tiny_llama_dir), load_state_dict(tiny_llama_dir)


def make_executor(model, num_blocks=32, num_cpu_blocks=8) -> CPUExecutor:
    cfg, state = model
    return CPUExecutor(cfg, state, CacheConfig(block_size=BS, num_blocks=num_blocks,
                                               num_cpu_blocks=num_cpu_blocks), torch.float32, 128)


def new(rid, prompt, blocks, computed=0) -> NewRequestData:
    return NewRequestData(rid, list(prompt), GREEDY, list(blocks), computed)


def step(ex, new_reqs=(), cached=(), sched=None, **kw) -> dict[str, list[int]]:
    sched = sched or {}
    so = SchedulerOutput(list(new_reqs), list(cached), dict(sched), sum(sched.values()), **kw)
    out = ex.execute_model(so)
    return dict(zip(out.req_ids, out.sampled_token_ids))


def generate_alone(model, prompt, n) -> list[int]:
    """Prefill, then n - 1 decodes, with a fresh executor and blocks 0, 1, 2, ..."""
    ex = make_executor(model)
    nb = -(-(len(prompt) + n) // BS)
    out = step(ex, [new("a", prompt, range(nb))], sched={"a": len(prompt)})["a"]
    for i in range(n - 1):
        out += step(ex, cached=[CachedRequestData("a", [], len(prompt) + i)], sched={"a": 1})["a"]
    return out


def test_kv_cache_swaps_and_moves_whole_blocks(model):
    cfg, _ = model
    kv = KVCache(cfg, num_blocks=6, num_cpu_blocks=3, block_size=BS, dtype=torch.float32)
    for layer in kv.kv_caches:
        for b in range(6):
            layer[:, b] = b + 1
    kv.swap_out([(4, 0), (5, 2)])
    kv.move([(1, 3)])
    kv.swap_in([(2, 0), (0, 1)])
    for layer, swap in zip(kv.kv_caches, kv.swap_caches):
        assert swap[:, 0].eq(5).all() and swap[:, 2].eq(6).all()
        assert [int(layer[0, b, 0, 0, 0]) for b in range(6)] == [6, 5, 3, 2, 5, 6]
        assert layer[1].eq(layer[0]).all()  # values moved with their keys
    assert bytes_per_block(cfg, BS, torch.float32) == kv.kv_caches[0].numel() // 6 * 4 * len(kv.kv_caches)


def test_swap_without_swap_space_is_a_clear_error(model):
    kv = KVCache(model[0], num_blocks=4, num_cpu_blocks=0, block_size=BS, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="swap-space"):
        kv.swap_out([(0, 0)])


def test_prefill_chunks_and_decodes_mixed_in_one_batch(model):
    ref_a = generate_alone(model, PROMPT, 4)
    ref_b = generate_alone(model, PROMPT[::-1], 3)
    ex = make_executor(model)
    # a: whole prompt; b: first chunk of 6 (no token sampled)
    out = step(ex, [new("a", PROMPT, [0, 1, 2]), new("b", PROMPT[::-1], [3, 4])],
               sched={"a": 10, "b": 6})
    assert out == {"a": ref_a[:1], "b": []}
    # a decodes while b finishes its prompt (4 tokens, new block 5)
    out = step(ex, cached=[CachedRequestData("a", [], 10), CachedRequestData("b", [5], 6)],
               sched={"a": 1, "b": 4})
    assert out == {"a": ref_a[1:2], "b": ref_b[:1]}
    out = step(ex, cached=[CachedRequestData("b", [], 10), CachedRequestData("a", [], 11)],
               sched={"b": 1, "a": 1})
    assert out == {"a": ref_a[2:3], "b": ref_b[1:2]}
    # a finishes; b keeps its row and decodes on
    out = step(ex, cached=[CachedRequestData("b", [], 11)], sched={"b": 1}, finished_req_ids={"a"})
    assert out == {"b": ref_b[2:3]}
    assert list(ex.runner.batch.req_id_to_row) == ["b"]


def test_resumed_request_gets_a_new_block_table_and_the_scheduler_tokens(model):
    ref = generate_alone(model, PROMPT, 4)
    ex = make_executor(model)
    got = step(ex, [new("a", PROMPT, [0, 1, 2])], sched={"a": 10})["a"]
    got += step(ex, cached=[CachedRequestData("a", [], 10)], sched={"a": 1})["a"]
    # Preempted by recompute, then resumed on other blocks: all 12 tokens are recomputed.
    got += step(ex, cached=[CachedRequestData("a", [10, 11, 12, 13], 0, True, list(got))],
                sched={"a": 12})["a"]
    got += step(ex, cached=[CachedRequestData("a", [], 12)], sched={"a": 1})["a"]
    assert got == ref


def test_swapped_out_and_in_blocks_keep_their_kv(model):
    ref = generate_alone(model, PROMPT, 3)
    ex = make_executor(model)
    got = step(ex, [new("a", PROMPT, [0, 1, 2])], sched={"a": 10})["a"]
    step(ex, blocks_to_swap_out=[(0, 5), (1, 6), (2, 7)])
    ex.kv_cache.kv_caches[0][:, :3] = 123.0  # the device blocks get reused by someone else
    got += step(ex, cached=[CachedRequestData("a", [4, 3, 8], 10, True, list(got))],
                sched={"a": 1}, blocks_to_swap_in=[(5, 4), (6, 3), (7, 8)])["a"]
    got += step(ex, cached=[CachedRequestData("a", [], 11)], sched={"a": 1})["a"]
    assert got == ref


def test_rows_are_reused_and_state_grows_past_its_initial_capacity(model):
    ex = make_executor(model, num_blocks=400)
    reqs = [new(f"r{i}", [i + 3, 7], [i]) for i in range(100)]
    out = step(ex, reqs, sched={r.req_id: 2 for r in reqs})
    assert len(out) == 100 and all(len(t) == 1 for t in out.values())
    assert ex.runner.batch.capacity >= 100
    rows_before = set(ex.runner.batch.req_id_to_row.values())
    step(ex, finished_req_ids={f"r{i}" for i in range(100)})
    assert len(ex.runner.batch) == 0
    step(ex, [new("x", [3, 7], [0])], sched={"x": 2})
    assert ex.runner.batch.req_id_to_row["x"] in rows_before


def test_token_without_a_block_is_a_clear_error(model):
    ex = make_executor(model)
    with pytest.raises(RuntimeError, match="no KV block"):
        step(ex, [new("a", PROMPT, [0, 1])], sched={"a": 10})  # needs 3 blocks


def test_factory_sizes_the_kv_cache_from_memory(tiny_llama_dir, model):
    cfg = model[0]
    per_block = bytes_per_block(cfg, 16, torch.float32)
    args = EngineArgs(model=str(tiny_llama_dir), kv_cache_memory=str(per_block * 10 + 5),
                      swap_space=f"{per_block * 3}B", num_threads=1)  # bare numbers are GiB
    assert kv_cache_blocks(args, cfg, torch.float32) == (10, 0)  # no swap space unless swapping
    args.preemption_mode = "swap"
    assert kv_cache_blocks(args, cfg, torch.float32) == (10, 3)
    args.num_gpu_blocks = 7
    assert kv_cache_blocks(args, cfg, torch.float32) == (7, 3)
    args = EngineArgs(model=str(tiny_llama_dir), kv_cache_memory="100", num_threads=1)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        kv_cache_blocks(args, cfg, torch.float32)


def test_factory_resolves_max_model_len(tiny_llama_dir, model):
    cfg = model[0]  # max_position_embeddings 512
    assert resolve_max_model_len(0, cfg) == 512
    assert resolve_max_model_len(100, cfg) == 100
    with pytest.raises(ValueError, match="max-model-len 512"):
        resolve_max_model_len(1000, cfg)
    core = create_engine_core(EngineArgs(model=str(tiny_llama_dir), num_threads=1,
                                         kv_cache_memory="1MiB", max_model_len=64))
    assert core.model_info.max_model_len == 64 and core.model_info.vocab_size == cfg.vocab_size
    assert core.scheduler.config.max_model_len == 64
    assert core.scheduler.cache_config.num_blocks == (2**20) // bytes_per_block(cfg, 16, torch.float32)
    assert core.model_info.model_path == tiny_llama_dir.resolve()


def _same(a, b) -> None:
    """Two step-input structures hold the same values (tensors, arrays, dataclasses)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("backend", ["c", "torch"])
def test_decode_fast_path_gives_the_general_paths_inputs_and_tokens(model, backend, monkeypatch):
    """A step of one-token queries takes ``_prepare_decodes``: the same flat batch (order by
    context length, slots, positions, attention plan, sampled rows) as the general path, so
    the same tokens; requests whose one token does not reach their end are not sampled."""
    cfg, state = model
    ex = CPUExecutor(cfg, state, CacheConfig(block_size=BS, num_blocks=64, num_cpu_blocks=0),
                     torch.float32, 128, attention_backend=backend)
    prompts = {"a": PROMPT, "b": PROMPT[:3], "c": PROMPT[::-1] + [4, 4, 4], "d": [8, 9, 10, 11]}
    blocks = {rid: list(range(8 * i, 8 * i + 8)) for i, rid in enumerate(prompts)}
    # d's prefill stops two tokens short: its next one-token step is not sampled.
    sched = {rid: len(p) - 2 * (rid == "d") for rid, p in prompts.items()}
    step(ex, [new(rid, p, blocks[rid]) for rid, p in prompts.items()], sched=sched)
    runner = ex.runner
    seen = []
    real = type(runner)._prepare_inputs

    def both(self, so, req_ids, num_spec=None):
        nct = self.batch.num_computed_tokens.copy()
        monkeypatch.setattr(model_runner, "DECODE_FAST_PATH", False)
        general = real(self, so, req_ids, num_spec)
        self.batch.num_computed_tokens[:] = nct
        monkeypatch.setattr(model_runner, "DECODE_FAST_PATH", True)
        fast = real(self, so, req_ids, num_spec)
        _same(general, fast)  # before the forward pass marks the plan checked
        seen.append(len(req_ids))
        return fast

    monkeypatch.setattr(type(runner), "_prepare_inputs", both)
    computed = dict(sched)
    outs = []
    for i in range(3):
        order = ["c", "a", "d", "b"] if i % 2 else ["b", "d", "a", "c"]
        cached = [CachedRequestData(r, [], computed[r]) for r in order]
        outs.append(step(ex, cached=cached, sched={r: 1 for r in order}))
        for r in order:
            computed[r] += 1
    assert outs[0]["d"] == [] and all(len(t) == 1 for r, t in outs[0].items() if r != "d")
    assert seen == [4, 4, 4]
    assert runner.batch.num_computed_tokens[runner.batch.req_id_to_row["a"]] == computed["a"]
    # The tokens of the whole run equal those of a run on the general path alone.
    monkeypatch.setattr(type(runner), "_prepare_inputs", real)
    monkeypatch.setattr(model_runner, "DECODE_FAST_PATH", False)
    ex2 = CPUExecutor(cfg, state, CacheConfig(block_size=BS, num_blocks=64, num_cpu_blocks=0),
                      torch.float32, 128, attention_backend=backend)
    step(ex2, [new(rid, p, blocks[rid]) for rid, p in prompts.items()], sched=sched)
    computed = dict(sched)
    for i in range(3):
        order = ["c", "a", "d", "b"] if i % 2 else ["b", "d", "a", "c"]
        cached = [CachedRequestData(r, [], computed[r]) for r in order]
        assert step(ex2, cached=cached, sched={r: 1 for r in order}) == outs[i]
        for r in order:
            computed[r] += 1


def test_decode_fast_path_keeps_the_clear_errors(model):
    ex = make_executor(model)
    step(ex, [new("a", PROMPT, [0, 1, 2])], sched={"a": 10})
    with pytest.raises(RuntimeError, match="past the tokens"):  # a's 11th token is not known
        step(ex, cached=[CachedRequestData("a", [], 11)], sched={"a": 1})
    ex = make_executor(model)
    step(ex, [new("a", PROMPT[:8], [0, 1])], sched={"a": 8})
    with pytest.raises(RuntimeError, match="no KV block"):  # position 8 needs a third block
        step(ex, cached=[CachedRequestData("a", [], 8)], sched={"a": 1})
