"""The fused decode layer (``kernels/decode_layer.c``): through the engine, every step's logits
equal those of the separate kernels bit for bit, in bfloat16 (decode steps of 1-8 rows use it,
larger ones and prefills do not) and in float32 (decode steps of up to 256 rows; steps with a
prefill do not), and bad inputs are refused with clear errors."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from llmtower.executor import model_runner
from llmtower.kernels import decode_layer as DL
from llmtower.kernels import ops
from llmtower.kernels.decode_layer import DecodeLayers, LayerParts
from llmtower.kernels.gemm_f32 import GemmF32Weight
from llmtower.kernels.gemv_bf16 import GemvWeight
from llmtower.kernels.kv_prefetch_choice import KvPrefetchChoice
from llmtower.models import linear as linear_mod
from llmtower.models import llama
from tests.executor.exactness_helpers import add_greedy, make_engine, random_prompts, run_all
from tests.fixtures.tiny_models import (  # noqa: F401  (pytest finds fixtures by name)
    make_tiny_model_dir,
    tiny_llama_dir,
    tiny_tokenizer_dir,
)



def _why_not(dtype: torch.dtype) -> str | None:
    return ops.capabilities().why_not_in("decode_layer", dtype)


needs_bf16 = pytest.mark.skipif(_why_not(torch.bfloat16) is not None,
                                reason=f"no fused bfloat16 layer here: {_why_not(torch.bfloat16)}")
needs_f32 = pytest.mark.skipif(_why_not(torch.float32) is not None,
                               reason=f"no fused float32 layer here: {_why_not(torch.float32)}")
# test modes -> (DL.WHOLE_STEP, DL.WHOLE_LAYERS): the whole step in one C call; layers
# 1 .. L-2 whole in C; one fused call per layer after a Python attention
MODES = {"step": (True, True), "layers": (False, True), "per_layer": (False, False)}


@pytest.fixture(autouse=True)
def _gemm_bf16_range(monkeypatch):
    """The fused layer's bfloat16 steps of 9-256 rows, as on a CPU without AMX (on one with
    it, models/linear.py leaves those rows to oneDNN, and the fused layer to few-row steps):
    these tests check the kernels' sums, whatever this CPU's dispatch."""
    monkeypatch.setattr(linear_mod, "BF16_KERNEL_MAX_ROWS", linear_mod.BF16_KERNEL_MAX_ROWS_AVX512)


@pytest.fixture(scope="module")
def odd_qwen2_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """Four layers with q/k/v biases and sizes that are no multiple of the kernel's tiles
    (hidden 96, 3:1 heads of 32, intermediate 200); norms and biases random too (they are
    ones and zeros at initialization, which would hide a mix-up)."""
    from safetensors.torch import load_file, save_file
    d = make_tiny_model_dir(tmp_path_factory, "qwen2", tokenizer_dir=tiny_tokenizer_dir,
                            hidden_size=96, num_layers=4, num_heads=3, num_kv_heads=1,
                            intermediate_size=200, initializer_range=0.2, seed=3)
    path = d / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        if t.dim() == 1:  # norm weights around 1, biases around 0
            base = 1.0 if name.endswith("norm.weight") else 0.0
            tensors[name] = base + 0.5 * torch.randn(t.shape, generator=g)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return d


def _run(model_dir: Path, prompts: list[list[int]], threads: int, monkeypatch,
         dtype: str = "bfloat16", **engine_kw
         ) -> tuple[dict[str, list[int]], list[torch.Tensor], list[int]]:
    """Greedy tokens, every step's logits, and the row counts of the steps that took the
    fused layer."""
    logits: list[torch.Tensor] = []
    fused_rows: list[int] = []
    # what the test itself wrapped, less an earlier run's recorders
    real_call = getattr(llama.LlamaForCausalLM.__call__, "inner", llama.LlamaForCausalLM.__call__)
    real_begin = getattr(DecodeLayers.begin_step, "inner", DecodeLayers.begin_step)

    def record_logits(self, *args):
        out = real_call(self, *args)
        logits.append(out.clone())
        return out

    def record_begin(self, t, *args):
        fused_rows.append(t)
        return real_begin(self, t, *args)

    record_logits.inner, record_begin.inner = real_call, real_begin  # type: ignore[attr-defined]
    # Every step's logits are compared: the greedy screen (which skips the output layer on
    # greedy steps) stays off; tests/kernels/test_greedy_head.py checks its tokens.
    monkeypatch.setattr(model_runner, "GREEDY_SCREEN", False)
    monkeypatch.setattr(llama.LlamaForCausalLM, "__call__", record_logits)
    monkeypatch.setattr(DecodeLayers, "begin_step", record_begin)
    core = make_engine(model_dir, dtype=dtype, num_threads=threads, **engine_kw)
    add_greedy(core, prompts, 12)
    return run_all(core), logits, fused_rows


def _record_spans(monkeypatch) -> tuple[list[tuple[int, int]], list[int]]:
    """The (first, count) of every attend_and_layers call and the rows of every step call."""
    spans: list[tuple[int, int]] = []
    steps: list[int] = []
    real_span, real_step = DecodeLayers.attend_and_layers, DecodeLayers.step

    def record_span(self, first, count, *args):
        spans.append((first, count))
        return real_span(self, first, count, *args)

    def record_step(self, h, *args):
        steps.append(h.shape[0])
        return real_step(self, h, *args)

    monkeypatch.setattr(DecodeLayers, "attend_and_layers", record_span)
    monkeypatch.setattr(DecodeLayers, "step", record_step)
    return spans, steps


@needs_bf16
@pytest.mark.parametrize("n, threads, mode", [
    (1, 1, "step"), (1, 2, "layers"), (1, 2, "per_layer"), (3, 2, "step"), (3, 1, "per_layer"),
    (7, 2, "step"), (9, 2, "layers"), (9, 1, "step"), (64, 2, "step"), (200, 1, "per_layer"),
    (300, 2, "step")])
def test_logits_equal_the_separate_kernels_bit_for_bit(odd_qwen2_dir, monkeypatch, n, threads,
                                                       mode):
    """``mode`` (MODES): the whole step in one C call (the output layer included), layers
    1 .. L-2 whole in C (attention included), or one fused call per layer after a Python
    attention. Steps of up to 8 rows take the few-row tiles, larger ones gemm_bf16's (where
    it runs; else they keep oneDNN and the separate calls), and steps of more than 256 rows
    the separate calls."""
    prompts = random_prompts(n, 3, 20, seed=n)
    max_rows = linear_mod.GEMV_MAX_ROWS if not ops.capabilities().can_run("gemm_bf16") \
        else max(linear_mod.GEMV_MAX_ROWS, linear_mod.BF16_KERNEL_MAX_ROWS)
    whole_step, whole = MODES[mode]
    monkeypatch.setattr(DL, "WHOLE_STEP", whole_step)
    monkeypatch.setattr(DL, "WHOLE_LAYERS", whole)
    spans, steps = _record_spans(monkeypatch)
    kw = dict(num_gpu_blocks=4096, max_num_batched_tokens=8192, max_num_seqs=512)  # 1 prefill
    tokens, logits, fused_rows = _run(odd_qwen2_dir, prompts, threads, monkeypatch, **kw)
    monkeypatch.setattr(DL, "MAX_ROWS", 0)  # off: the separate kernels of every op
    tokens_off, logits_off, fused_off = _run(odd_qwen2_dir, prompts, threads, monkeypatch, **kw)
    assert fused_off == []
    # Every decode step of up to max_rows rows took it (11 after the prefill: 12 tokens
    # each); prefills and larger steps did not.
    assert fused_rows == ([] if n > max_rows else [n] * 11)
    # Four layers: the whole step in C, or layer 0 and 3 from Python, 1 and 2 whole in C.
    fused = n <= max_rows
    assert steps == ([n] * 11 if mode == "step" and fused else [])
    assert spans == ([(1, 2)] * 11 if mode == "layers" and fused else [])
    assert tokens == tokens_off
    assert len(logits) == len(logits_off)
    for a, b in zip(logits, logits_off):
        assert torch.equal(a, b)


def test_the_model_uses_it_only_where_it_runs(odd_qwen2_dir, tiny_llama_dir):
    from llmtower.models.loader import load_model_config, load_state_dict
    for d in (odd_qwen2_dir, tiny_llama_dir):
        cfg = load_model_config(d)
        for dtype in (torch.bfloat16, torch.float32):
            m = llama.LlamaForCausalLM(cfg, load_state_dict(d, dtype), dtype, 64)
            if _why_not(dtype) is None:
                assert m.decode_layers is not None and m.decode_layers.dtype == dtype
            else:
                assert m.decode_layers is None
        m = llama.LlamaForCausalLM(cfg, load_state_dict(d, torch.float16), torch.float16, 64)
        assert m.decode_layers is None


def _parts(hidden=64, inter=96, nh=2, nkv=1, d=32, dtype=torch.bfloat16) -> LayerParts:
    g = torch.Generator().manual_seed(0)
    kind = GemvWeight if dtype == torch.bfloat16 else GemmF32Weight

    def w(n, k):
        return torch.randn(n, k, generator=g).to(dtype)
    qkv_n = (nh + 2 * nkv) * d
    ones = torch.ones(hidden, dtype=dtype)
    return LayerParts(kind(w(hidden, nh * d)), None, ones, kind(w(inter, hidden), w(inter, hidden)),
                      kind(w(hidden, inter)), ones, kind(w(qkv_n, hidden)), None)


@needs_bf16
def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="expected"):
        DecodeLayers([_parts(inter=128)], 64, 96, 2, 1, 32, 1e-6)  # MLP width off
    bad = _parts()
    bad.post_norm = torch.ones(64)  # float32
    with pytest.raises(ValueError, match="bfloat16"):
        DecodeLayers([bad], 64, 96, 2, 1, 32, 1e-6)
    layers = DecodeLayers([_parts()], 64, 96, 2, 1, 32, 1e-6)
    pos = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(TypeError, match="rotary tables"):
        layers.begin_step(1, torch.ones(8, 32), torch.ones(8, 32), pos, pos)
    layers.begin_step(1, torch.ones(8, 32).bfloat16(), torch.ones(8, 32).bfloat16(), pos, pos)
    h = torch.zeros(1, 64).bfloat16()
    cache = torch.zeros(2, 1, 4, 1, 32).bfloat16()
    with pytest.raises(ValueError, match="unit-stride"):
        layers.layer(0, h, torch.zeros(64, 2).bfloat16().T[:1], cache)
    with pytest.raises(ValueError, match="row count"):
        layers.layer(0, h, torch.zeros(2, 64).bfloat16(), cache)


@needs_f32
def test_bad_float32_inputs_are_refused():
    with pytest.raises(TypeError, match="GemmF32Weight"):  # bfloat16 kernel's matrices
        DecodeLayers([_parts()], 64, 96, 2, 1, 32, 1e-6, torch.float32)
    bad = _parts(dtype=torch.float32)
    bad.next_norm = torch.ones(64).bfloat16()
    with pytest.raises(ValueError, match="float32"):
        DecodeLayers([bad], 64, 96, 2, 1, 32, 1e-6, torch.float32)
    with pytest.raises(ValueError, match="float16"):
        DecodeLayers([_parts(dtype=torch.float32)], 64, 96, 2, 1, 32, 1e-6, torch.float16)
    layers = DecodeLayers([_parts(dtype=torch.float32)], 64, 96, 2, 1, 32, 1e-6, torch.float32)
    pos = torch.zeros(300, dtype=torch.int64)
    cos = torch.ones(8, 32)
    with pytest.raises(TypeError, match="rotary tables"):
        layers.begin_step(1, cos.bfloat16(), cos.bfloat16(), pos[:1], pos[:1])
    with pytest.raises(ValueError, match="rows"):
        layers.begin_step(300, cos, cos, pos, pos)
    layers.begin_step(2, cos, cos, pos[:2], pos[:2])
    h = torch.zeros(2, 64)
    cache = torch.zeros(2, 1, 4, 1, 32)
    with pytest.raises(ValueError, match="row count"):
        layers.layer(0, h, torch.zeros(3, 64), cache)


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """Three layers, tied embeddings, GQA 4:2, head_dim 16."""
    return make_tiny_model_dir(tmp_path_factory, "llama", tie=True, tokenizer_dir=tiny_tokenizer_dir,
                               hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                               intermediate_size=120, initializer_range=0.2, seed=7)


@needs_f32
@pytest.mark.parametrize("model, n, threads, mode", [
    ("odd_qwen2_dir", 1, 1, "step"), ("odd_qwen2_dir", 1, 2, "layers"),
    ("odd_qwen2_dir", 7, 2, "per_layer"), ("odd_qwen2_dir", 7, 1, "step"),
    ("odd_qwen2_dir", 64, 2, "step"), ("odd_qwen2_dir", 200, 1, "layers"),
    ("tied_llama_dir", 1, 2, "step"), ("tied_llama_dir", 7, 1, "layers"),
    ("tied_llama_dir", 64, 2, "per_layer")])
def test_float32_logits_equal_the_separate_kernels_bit_for_bit(request, monkeypatch, model, n,
                                                               threads, mode):
    """float32 decode steps of 1 to 200 rows (mixed context lengths), Qwen2 with biases and
    odd sizes, Llama tied; ``mode`` as for bfloat16. Fused and unfused take the same kernels,
    so the logits (and tokens) are equal bit for bit."""
    model_dir = request.getfixturevalue(model)
    prompts = random_prompts(n, 3, 30, seed=n)
    whole_step, whole = MODES[mode]
    monkeypatch.setattr(DL, "WHOLE_STEP", whole_step)
    monkeypatch.setattr(DL, "WHOLE_LAYERS", whole)
    spans, steps = _record_spans(monkeypatch)
    kw = dict(dtype="float32", num_gpu_blocks=2048, max_num_batched_tokens=8192)  # 1 prefill
    tokens, logits, fused_rows = _run(model_dir, prompts, threads, monkeypatch, **kw)
    monkeypatch.setattr(DL, "MAX_ROWS", 0)
    tokens_off, logits_off, fused_off = _run(model_dir, prompts, threads, monkeypatch, **kw)
    assert fused_off == []
    assert fused_rows == [n] * 11  # every decode step after the prefill
    layers = 4 if model == "odd_qwen2_dir" else 3
    assert steps == ([n] * 11 if mode == "step" else [])
    assert spans == ([(1, layers - 2)] * 11 if mode == "layers" else [])
    assert tokens == tokens_off
    assert len(logits) == len(logits_off)
    for a, b in zip(logits, logits_off):
        assert torch.equal(a, b)


@needs_f32
@pytest.mark.parametrize("mode", ["step", "layers"])
def test_the_kv_prefetch_trial_runs_both_settings_and_changes_no_value(odd_qwen2_dir,
                                                                        monkeypatch, mode):
    """With the setting left to the trial (kernels/kv_prefetch_choice.py), the first decode
    steps of 16+ rows run with and without the K/V stream in turn, the trial decides, and every
    logit is the separate kernels' bit for bit (the stream only prefetches)."""
    whole_step, whole = MODES[mode]
    monkeypatch.setattr(DL, "WHOLE_STEP", whole_step)
    monkeypatch.setattr(DL, "WHOLE_LAYERS", whole)
    monkeypatch.setattr(DL, "PREFETCH_KV", None)
    monkeypatch.delenv("LLMTOWER_PREFETCH_KV", raising=False)
    choices: list[KvPrefetchChoice] = []
    seen: list[tuple[int, bool]] = []  # (rows, the C library's setting) per whole-layer call
    real_timed = DecodeLayers._timed

    def record_timed(self, fn, *args):
        if not choices:
            self.prefetch_choice = KvPrefetchChoice(pairs=3)
            choices.append(self.prefetch_choice)
        rc = real_timed(self, fn, *args)
        seen.append((self._step.t, bool(self._prefetch_kv.value)))
        return rc

    monkeypatch.setattr(DecodeLayers, "_timed", record_timed)
    prompts = random_prompts(20, 3, 30, seed=3)
    kw = dict(dtype="float32", num_gpu_blocks=2048, max_num_batched_tokens=8192)
    tokens, logits, _ = _run(odd_qwen2_dir, prompts, 2, monkeypatch, **kw)
    monkeypatch.setattr(DL, "MAX_ROWS", 0)
    tokens_off, logits_off, _ = _run(odd_qwen2_dir, prompts, 2, monkeypatch, **kw)
    assert len(seen) == 11 and all(rows == 20 for rows, _ in seen)
    trial = [on for _, on in seen[:6]]
    assert trial.count(True) == trial.count(False) == 3  # three pairs, each both ways
    assert choices[0].decided is not None and len(choices[0].ratios) == 3
    assert all(on is choices[0].decided for _, on in seen[6:])
    assert tokens == tokens_off
    assert all(torch.equal(a, b) for a, b in zip(logits, logits_off, strict=True))


@needs_f32
def test_float32_steps_with_a_prefill_take_the_separate_kernels(odd_qwen2_dir, monkeypatch):
    """Chunked prefills beside running decodes (a small token budget): those steps take the
    separate kernels, the pure decode steps the fused layer, and the tokens are those of the
    separate kernels everywhere."""
    prompts = random_prompts(6, 20, 60, seed=11)
    calls: list[tuple[bool, int]] = []  # (the step has a prefill, begin_step was called)
    real_fused, real_begin = llama.LlamaForCausalLM._forward_fused, DecodeLayers.begin_step

    def record_fused(self, fo, input_ids, positions, kv_caches, attn, meta, *rest):
        calls.append((bool(meta.prefills), False))
        return real_fused(self, fo, input_ids, positions, kv_caches, attn, meta, *rest)

    def record_begin(self, *args):
        calls[-1] = (calls[-1][0], True)
        return real_begin(self, *args)

    monkeypatch.setattr(llama.LlamaForCausalLM, "_forward_fused", record_fused)
    monkeypatch.setattr(DecodeLayers, "begin_step", record_begin)
    kw = dict(dtype="float32", max_num_batched_tokens=24, max_num_seqs=6)
    tokens, logits, _ = _run(odd_qwen2_dir, prompts, 2, monkeypatch, **kw)
    steps = list(calls)
    monkeypatch.setattr(DL, "MAX_ROWS", 0)
    tokens_off, logits_off, _ = _run(odd_qwen2_dir, prompts, 2, monkeypatch, **kw)
    assert any(p and not fused for p, fused in steps[:len(steps) // 2])  # mixed steps happened
    assert all(fused != prefill for prefill, fused in steps)
    assert tokens == tokens_off
    assert all(torch.equal(a, b) for a, b in zip(logits, logits_off, strict=True))


def _direct_step(model_dir: Path, dtype: torch.dtype, t: int, rows: list[int], whole_step: bool,
                 monkeypatch, bad_table: bool = False, no_head: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One pure decode step of ``t`` requests (random caches, contexts of 1 to 40 tokens)
    through the model's forward, sampling ``rows``: (logits, layer 0's and the last layer's
    caches after it)."""
    from llmtower.executor.kv_cache import KVCache
    from llmtower.models.attention import AttentionMetadata, DecodeBatch, PagedAttention
    from llmtower.models.loader import load_model_config, load_state_dict
    monkeypatch.setattr(DL, "WHOLE_STEP", whole_step)
    cfg = load_model_config(model_dir)
    model = llama.LlamaForCausalLM(cfg, load_state_dict(model_dir, dtype), dtype, 64)
    assert model.decode_layers is not None
    if no_head:  # the output layer left to _logits (as where it has no decode-kernel copy)
        model.decode_layers = DecodeLayers(
            model.decode_layers._keep, cfg.hidden_size, cfg.intermediate_size,
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps,
            dtype, dataclasses.replace(model.decode_layers._ends_keep, head=None))
    bs, nb = 4, 128
    kv = KVCache(cfg, num_blocks=nb, num_cpu_blocks=0, block_size=bs, dtype=dtype)
    g = torch.Generator().manual_seed(t)
    for c in kv.kv_caches:
        c.copy_(torch.randn(c.shape, generator=g).to(dtype))
    lens = torch.randint(1, 41, (t,), generator=g)
    tables = torch.randperm(nb, generator=g)[:t * 10].view(t, 10).contiguous()
    if bad_table:  # a block before the new token's, past the cache
        lens[0] = 20
        tables[0, 0] = nb
    pos = lens - 1
    slots = tables.gather(1, (pos // bs).view(t, 1)).view(t) * bs + pos % bs
    attn = PagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, bs,
                          dtype, gather_buffer_blocks=16, backend="c")
    meta = AttentionMetadata(t, slots, decodes=DecodeBatch(t, tables, lens))
    ids = torch.randint(3, cfg.vocab_size, (t,), generator=g)
    logits = model(ids, pos, kv.kv_caches, attn, meta, torch.tensor(rows, dtype=torch.int64))
    return logits, torch.stack([kv.kv_caches[0], kv.kv_caches[-1]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t, rows, threads, no_head", [
    (5, [3, 0, 4], 1, False), (4, [1, 0, 3, 2], 2, False), (12, [11, 2], 2, False),
    (1, [0], 1, False), (3, [0, 1, 2], 2, True), (6, [5, 1], 1, True)])
def test_whole_step_samples_any_rows_bit_for_bit(odd_qwen2_dir, monkeypatch, dtype, t, rows,
                                                 threads, no_head):
    """The whole step in C, sampling a subset of the rows or all of them out of order (its
    gathered path), with or without the output layer, equals the step with layer 0 and the
    last layer in Python bit for bit, logits and written K/V alike."""
    if _why_not(dtype) is not None:
        pytest.skip(f"no fused {dtype} layer here")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _compare_whole_step(odd_qwen2_dir, monkeypatch, dtype, t, rows, no_head)
    finally:
        torch.set_num_threads(before)


def _compare_whole_step(odd_qwen2_dir, monkeypatch, dtype, t, rows, no_head):
    steps: list[int] = []
    real_step = DecodeLayers.step

    def record_step(self, h, *args):
        steps.append(h.shape[0])
        return real_step(self, h, *args)

    monkeypatch.setattr(DecodeLayers, "step", record_step)
    logits, caches = _direct_step(odd_qwen2_dir, dtype, t, rows, True, monkeypatch,
                                  no_head=no_head)
    assert steps == [t]
    ref, ref_caches = _direct_step(odd_qwen2_dir, dtype, t, rows, False, monkeypatch)
    assert steps == [t]
    assert logits.shape == (len(rows), 512) and logits.dtype == torch.float32
    assert torch.equal(logits, ref)
    assert torch.equal(caches, ref_caches)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_whole_step_refuses_bad_tables_and_rows(odd_qwen2_dir, monkeypatch, dtype):
    if _why_not(dtype) is not None:
        pytest.skip(f"no fused {dtype} layer here")
    with pytest.raises(ValueError, match="block ids"):
        _direct_step(odd_qwen2_dir, dtype, 3, [0, 1, 2], True, monkeypatch, bad_table=True)
    with pytest.raises(ValueError, match="sampled rows must be in 0..2"):
        _direct_step(odd_qwen2_dir, dtype, 3, [0, 3], True, monkeypatch)
    # more sampled rows than the step has (a row twice): the split path takes the step
    calls: list[int] = []
    real_step = DecodeLayers.step
    monkeypatch.setattr(DecodeLayers, "step", lambda self, *a: calls.append(1) or real_step(
        self, *a))
    logits, _ = _direct_step(odd_qwen2_dir, dtype, 3, [0, 1, 2, 0], True, monkeypatch)
    assert calls == [] and logits.shape[0] == 4 and torch.equal(logits[0], logits[3])
