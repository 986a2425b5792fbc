"""The fused GGUF decode layer (``kernels/quant_layer.c``): through the engine, every float32
decode step of up to BLOCK_KERNEL_MAX_ROWS rows over block weights takes it, and its logits
equal those of the separate block-kernel calls bit for bit, whatever the mix of formats in a
matrix (q/k/v and gate/up of two formats each), the thread count and whether the attention
runs from Python or inside the C loop; bad inputs are refused."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmtower.executor import model_runner
from llmtower.kernels import decode_layer as DL
from llmtower.kernels import ops
from llmtower.kernels import quant_layer as QL
from llmtower.kernels.quant_layer import QuantDecodeLayers
from llmtower.models import llama
from llmtower.models.quant_block import BLOCK_KERNEL_MAX_ROWS
from tests.executor.exactness_helpers import add_greedy, make_engine, random_prompts, run_all
from tests.fixtures.tiny_gguf import write_gguf_from_hf_dir
from tests.fixtures.tiny_models import (  # noqa: F401  (pytest finds fixtures by name)
    make_tiny_model_dir,
    tiny_tokenizer_dir,
)
from tests.kernels.test_quant_gemm import _HALVES

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not ops.capabilities().can_run("quant_gemm"),
                                reason=f"{ops.capabilities().why_not('quant_gemm')}")

# Per layer: (q, k, v, o, gate, up, down) formats; two formats in qkv and gate/up somewhere.
_MIX = [(Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K),
        (Q.Q8_0, Q.Q8_0, Q.Q8_0, Q.Q4_1, Q.Q4_0, Q.Q4_0, Q.Q4_K),
        (Q.Q5_K, Q.Q5_K, Q.Q4_0, Q.Q6_K, Q.Q4_1, Q.Q4_1, Q.Q5_K)]
_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks with scales of 1e-3 .. 1e-2 (weights of a few hundredths)."""
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    nb = n * k // values
    b = rng.integers(0, 256, (nb, nbytes), dtype=np.uint8)
    for off in _HALVES[qtype]:
        s = (rng.uniform(1e-3, 1e-2, nb) * rng.choice([-1, 1], nb)).astype(np.float16)
        b[:, off:off + 2] = s.view(np.uint8).reshape(nb, 2)
    return b.reshape(n, k // values * nbytes)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """Three layers (hidden 256, 4 heads of 64, 2 KV heads, intermediate 512) of random blocks
    in the mixes of ``_MIX``; Q6_K output layer, Q8_0 embeddings."""
    d = make_tiny_model_dir(tmp_path_factory, "llama", tokenizer_dir=tiny_tokenizer_dir,
                            hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=2,
                            intermediate_size=512, seed=4, random_norms=True)
    rng = np.random.default_rng(9)
    real = gguf.quants.quantize

    def qtype_of(name: str, _w: np.ndarray) -> Q:
        if "embed" in name:
            return Q.Q8_0
        if "lm_head" in name:
            return Q.Q6_K
        layer = int(name.split(".")[2])
        return next(q for n, q in zip(_NAMES, _MIX[layer]) if f".{n}." in name)

    def quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
        # gguf's package has no K-format quantizer: random blocks (the test compares two
        # paths over the same file, not against the float model)
        if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            return _blocks(qtype, w.shape[0], w.shape[1], rng)
        return real(w, qtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.quants, "quantize", quantize)
        return write_gguf_from_hf_dir(d, tmp_path_factory.mktemp("mix") / "mix.gguf",
                                      qtype_of=qtype_of)


def _run(path: Path, prompts: list[list[int]], threads: int, monkeypatch
         ) -> tuple[dict[str, list[int]], list[torch.Tensor], list[int]]:
    """Greedy tokens, every step's logits and the row counts of the fused steps."""
    logits: list[torch.Tensor] = []
    fused: list[int] = []
    real_call = getattr(llama.LlamaForCausalLM.__call__, "inner", llama.LlamaForCausalLM.__call__)
    real_begin = getattr(QuantDecodeLayers.begin_step, "inner", QuantDecodeLayers.begin_step)

    def record_logits(self, *args):
        out = real_call(self, *args)
        logits.append(out.clone())
        return out

    def record_begin(self, t, *args):
        fused.append(t)
        return real_begin(self, t, *args)

    record_logits.inner, record_begin.inner = real_call, real_begin  # type: ignore[attr-defined]
    monkeypatch.setattr(model_runner, "GREEDY_SCREEN", False)
    monkeypatch.setattr(llama.LlamaForCausalLM, "__call__", record_logits)
    monkeypatch.setattr(QuantDecodeLayers, "begin_step", record_begin)
    core = make_engine(path, quantization="gguf", dtype="float32", num_threads=threads,
                       num_gpu_blocks=2048, max_num_batched_tokens=8192, max_num_seqs=256)
    add_greedy(core, prompts, 8)
    return run_all(core), logits, fused


@pytest.mark.parametrize("n, threads, whole", [(1, 1, True), (1, 2, False), (5, 2, True),
                                               (5, 1, False), (BLOCK_KERNEL_MAX_ROWS + 4, 2, True)])
def test_logits_equal_the_separate_block_kernels_bit_for_bit(mixed_gguf, monkeypatch, n, threads,
                                                             whole):
    """Decode steps of 1 to BLOCK_KERNEL_MAX_ROWS rows take the fused layer (with ``whole``,
    layer 1 whole in C, its attention included); larger steps the separate calls; the
    logits and tokens equal the separate calls' everywhere."""
    spans: list[tuple[int, int]] = []
    real_span = QuantDecodeLayers.attend_and_layers

    def record_span(self, first, count, *args):
        spans.append((first, count))
        return real_span(self, first, count, *args)

    monkeypatch.setattr(QuantDecodeLayers, "attend_and_layers", record_span)
    monkeypatch.setattr(QL, "WHOLE_LAYERS", whole)
    prompts = random_prompts(n, 3, 20, seed=n)
    tokens, logits, fused = _run(mixed_gguf, prompts, threads, monkeypatch)
    monkeypatch.setattr(DL, "MAX_ROWS", 0)  # off: the separate calls
    tokens_off, logits_off, fused_off = _run(mixed_gguf, prompts, threads, monkeypatch)
    assert fused_off == []
    assert fused == ([n] * 7 if n <= BLOCK_KERNEL_MAX_ROWS else [])
    assert spans == ([(1, 1)] * 7 if n <= BLOCK_KERNEL_MAX_ROWS and whole else [])
    assert tokens == tokens_off
    assert len(logits) == len(logits_off)
    for a, b in zip(logits, logits_off):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


def test_only_float32_models_whose_products_all_take_the_block_kernel_use_it(mixed_gguf):
    from llmtower.models.gguf_weights import gguf_block_state_dict
    from llmtower.models.gguf_loader import gguf_model_config, open_gguf

    cfg = gguf_model_config(open_gguf(mixed_gguf))
    model = llama.LlamaForCausalLM(cfg, gguf_block_state_dict(mixed_gguf, cfg), torch.float32,
                                   64, quantization="gguf")
    assert isinstance(model.decode_layers, QuantDecodeLayers)
    assert model._kernel_rows() == BLOCK_KERNEL_MAX_ROWS
    bf16 = llama.LlamaForCausalLM(cfg, gguf_block_state_dict(mixed_gguf, cfg), torch.bfloat16,
                                  64, quantization="gguf")
    assert bf16.decode_layers is None
    assert not QL.fits(96, 512, 4, 24)  # k not a multiple of 256


def test_bad_inputs_are_refused(mixed_gguf):
    from llmtower.models.gguf_weights import gguf_block_state_dict
    from llmtower.models.gguf_loader import gguf_model_config, open_gguf

    cfg = gguf_model_config(open_gguf(mixed_gguf))
    model = llama.LlamaForCausalLM(cfg, gguf_block_state_dict(mixed_gguf, cfg), torch.float32,
                                   64, quantization="gguf")
    dl = model.decode_layers
    assert isinstance(dl, QuantDecodeLayers)
    cos, sin = model.rope.tables()
    pos = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(TypeError, match="float32"):
        dl.begin_step(2, cos.bfloat16(), sin.bfloat16(), pos, pos)
    with pytest.raises(ValueError, match="LoRA"):
        dl.begin_step(2, cos, sin, pos, pos, lora=object())
    dl.begin_step(2, cos, sin, pos, pos)
    h = torch.zeros(2, 256)
    cache = torch.zeros(2, 4, 4, 2, 64)
    with pytest.raises(ValueError, match="row count"):
        dl.layer(0, h, torch.zeros(3, 256), cache)
    with pytest.raises(ValueError, match="float32"):
        dl.layer(0, h, torch.zeros(2, 256, dtype=torch.bfloat16), cache)
    parts = dl._keep[0]
    with pytest.raises(ValueError, match="expected"):
        dl._matrix(parts.o, 512, 256)
