"""Decode steps with adapter rows in the fused C decode layer (``kernels/decode_layer.c``'s
LoRA hooks): the whole step in one C call, or one C call per layer, gives the logits and K/V of
the per-product torch path (``lora/punica.py``, the fused layer switched off) up to float32
rounding; in the whole step, rows without an adapter are bit for bit those of a step without
LoRA."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from llmtower.kernels import decode_layer as DL
from llmtower.kernels import ops
from llmtower.kernels.decode_layer import DecodeLayers
from llmtower.lora.adapter import LoRAAdapter, LoRAModelShape
from llmtower.lora.punica import LoRAStep, StackedLoRA
from llmtower.models import llama
from tests.fixtures.tiny_models import make_tiny_model_dir

pytestmark = pytest.mark.skipif(
    ops.capabilities().why_not_in("decode_layer", torch.float32) is not None,
    reason="no fused float32 decode layer here")

# test modes -> (DL.WHOLE_STEP, DL.WHOLE_LAYERS, DL.MAX_ROWS)
MODES = {"step": (True, True, 256), "per_layer": (False, False, 256), "off": (True, True, 0)}


@pytest.fixture(scope="module")
def odd_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """Three layers, sizes no multiple of the vector width (hidden 96, intermediate 200, heads
    of 32, 3:1), q/k/v biases."""
    return make_tiny_model_dir(tmp_path_factory, "qwen2", tokenizer_dir=tiny_tokenizer_dir,
                               hidden_size=96, num_layers=3, num_heads=3, num_kv_heads=1,
                               intermediate_size=200, initializer_range=0.2, seed=3)


def _adapters(shape: LoRAModelShape) -> list[LoRAAdapter]:
    """Three adapters of different ranks: every projection; q and v only; the MLP only."""
    g = torch.Generator().manual_seed(7)
    specs = [(5, shape.dims), (8, ("q_proj", "v_proj")), (3, ("gate_proj", "up_proj",
                                                              "down_proj"))]
    out = []
    for k, (rank, modules) in enumerate(specs):
        a = {m: 0.3 * torch.randn(shape.num_layers, rank, shape.dims[m][0], generator=g)
             for m in modules}
        b = {m: 0.3 * torch.randn(shape.num_layers, shape.dims[m][1], rank, generator=g)
             for m in modules}
        out.append(LoRAAdapter(f"a{k}", k + 1, rank, 1.0, a, b))
    return out


@pytest.fixture(scope="module")
def odd_model(odd_dir) -> llama.LlamaForCausalLM:
    from llmtower.models.loader import load_model_config, load_state_dict
    cfg = load_model_config(odd_dir)
    model = llama.LlamaForCausalLM(cfg, load_state_dict(odd_dir, torch.float32), torch.float32,
                                   64)
    assert model.decode_layers is not None
    return model


def _step(model: llama.LlamaForCausalLM, t: int, rows: list[int], row_slot: list[int] | None,
          mode: str, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One pure decode step of ``t`` requests (random caches, contexts of 1 to 40 tokens)
    sampling ``rows``, row i with adapter slot row_slot[i] (-1 none; None: no LoRA at all):
    (logits, layer 0's and the last layer's caches, the rows of each fused begin_step)."""
    from llmtower.executor.kv_cache import KVCache
    from llmtower.models.attention import AttentionMetadata, DecodeBatch, PagedAttention
    whole_step, whole_layers, max_rows = MODES[mode]
    monkeypatch.setattr(DL, "WHOLE_STEP", whole_step)
    monkeypatch.setattr(DL, "WHOLE_LAYERS", whole_layers)
    monkeypatch.setattr(DL, "MAX_ROWS", max_rows)
    begun: list[int] = []
    real_begin = getattr(DecodeLayers.begin_step, "inner", DecodeLayers.begin_step)

    def record_begin(self, t_, *args):
        begun.append(t_)
        return real_begin(self, t_, *args)

    record_begin.inner = real_begin  # type: ignore[attr-defined]
    monkeypatch.setattr(DecodeLayers, "begin_step", record_begin)
    dtype = torch.float32
    cfg = model.config
    shape = LoRAModelShape.from_config(cfg)
    lora = None
    if row_slot is not None:
        stack = StackedLoRA(_adapters(shape), shape.num_layers, dtype, shape.dims)
        lora = LoRAStep(stack, np.array(row_slot, dtype=np.int64))
    bs, nb = 4, 256
    kv = KVCache(cfg, num_blocks=nb, num_cpu_blocks=0, block_size=bs, dtype=dtype)
    g = torch.Generator().manual_seed(t)
    for c in kv.kv_caches:
        c.copy_(torch.randn(c.shape, generator=g))
    lens = torch.randint(1, 41, (t,), generator=g)
    tables = torch.randperm(nb, generator=g)[:t * 10].view(t, 10).contiguous()
    pos = lens - 1
    slots = tables.gather(1, (pos // bs).view(t, 1)).view(t) * bs + pos % bs
    attn = PagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, bs,
                          dtype, gather_buffer_blocks=16, backend="c")
    meta = AttentionMetadata(t, slots, decodes=DecodeBatch(t, tables, lens))
    ids = torch.randint(3, cfg.vocab_size, (t,), generator=g)
    logits = model(ids, pos, kv.kv_caches, attn, meta, torch.tensor(rows, dtype=torch.int64),
                   lora=lora)
    return logits, torch.stack([kv.kv_caches[0], kv.kv_caches[-1]]), begun


@pytest.mark.parametrize("mode, t, rows, row_slot, threads", [
    ("step", 6, list(range(6)), [0, -1, 1, 2, 0, 1], 1),
    ("per_layer", 6, list(range(6)), [0, -1, 1, 2, 0, 1], 2),
    ("step", 5, [3, 0, 4], [2, 2, -1, 0, 1], 2),  # the sampled rows gathered
    ("step", 13, list(range(13)), [1, 0, -1, 0, 2, 2, 2, 1, -1, 0, 0, 1, 2], 2)])
def test_fused_lora_equals_the_torch_path(odd_model, monkeypatch, mode, t, rows, row_slot,
                                          threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        logits, caches, begun = _step(odd_model, t, rows, row_slot, mode, monkeypatch)
        assert begun == [t]  # the step took the fused layer, adapters and all
        ref, ref_caches, begun_off = _step(odd_model, t, rows, row_slot, "off", monkeypatch)
        assert begun_off == []
        plain, plain_caches, _ = _step(odd_model, t, rows, None, mode, monkeypatch)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches, ref_caches, rtol=1e-4, atol=1e-4)
    sampled_slot = [row_slot[r] for r in rows]
    for k, s in enumerate(sampled_slot):
        if s < 0 and mode == "step":  # all in C: a row without an adapter gets nothing
            assert torch.equal(logits[k], plain[k])
        elif s < 0:  # the last layer's torch path reads gate and up apart for every row
            torch.testing.assert_close(logits[k], plain[k], rtol=1e-4, atol=1e-4)
        else:  # the adapters change the rows that have one (else this could not fail)
            assert (logits[k] - plain[k]).abs().max() > 1e-2


def test_lora_rows_must_match_the_layers(odd_model):
    """Adapter matrices of another model's shape are refused before the C code reads them."""
    model, cfg = odd_model, odd_model.config
    dl = model.decode_layers
    assert dl is not None and dl.takes_lora
    shape = LoRAModelShape.from_config(cfg)
    wrong = LoRAModelShape(shape.num_layers, {**shape.dims, "down_proj": (100, 96)})
    stack = StackedLoRA(_adapters(wrong), shape.num_layers, torch.float32, wrong.dims)
    rows = LoRAStep(stack, np.array([0, -1])).decode_rows()
    cos, sin = model.rope.tables()
    with pytest.raises(ValueError, match="LoRA down matrices take 100 inputs"):
        dl.begin_step(2, cos, sin, torch.zeros(2, dtype=torch.int64),
                      torch.zeros(2, dtype=torch.int64), rows)
    with pytest.raises(ValueError, match="adapter rows for 2 rows in a step of 3"):
        ok = StackedLoRA(_adapters(shape), shape.num_layers, torch.float32, shape.dims)
        dl.begin_step(3, cos, sin, torch.zeros(3, dtype=torch.int64),
                      torch.zeros(3, dtype=torch.int64),
                      LoRAStep(ok, np.array([0, -1])).decode_rows())
