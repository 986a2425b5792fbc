"""The model's GEMMs: weights packed once at load give exactly the plain weights' results."""
from __future__ import annotations

import os

import pytest
import torch

import llmtower.models.layers.head as head_module
import llmtower.models.layers.weights as weights_module
from llmtower.models import linear as L
from llmtower.utils import cpu_info
from tests.models.test_llama import IDS, our_logits

needs_packing = pytest.mark.skipif(L.prepack is L._identity,
                                   reason="this torch has no oneDNN weight packing")


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_weight_gives_the_plain_weights_results(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(160, 96, generator=g).to(dtype)
    up = torch.randn(160, 96, generator=g).to(dtype)
    bias = torch.randn(160, generator=g).to(dtype)
    pw, pup = L.prepack(w), L.prepack(up)
    onednn = pw.onednn if isinstance(pw, L.PackedWeight) else pw
    assert onednn.is_mkldnn and tuple(pw.shape) == (160, 96)
    # One float32 row: the plain weight takes a GEMV (another summation order); bfloat16
    # decode-step rows: the few-row kernel (tests/kernels/test_gemv_bf16.py) or gemm_bf16
    # (tests/kernels/test_gemm_bf16.py); float32 decode-step rows: gemm_f32
    # (tests/models/test_linear_f32.py).
    few_row_kernel = isinstance(pw, L.PackedWeight) and rows <= (
        L.F32_KERNEL_MAX_ROWS if pw.f32 else max(L.GEMV_MAX_ROWS, L.BF16_KERNEL_MAX_ROWS))
    if rows > 1 and not few_row_kernel:
        assert torch.equal(L.linear(x, pw, bias), L.linear(x, w, bias))
        assert torch.equal(L.silu_mul(x, pw, pup), L.silu_mul(x, w, up))
    torch.testing.assert_close(L.linear(x, pw).float(), (x.float() @ w.float().T),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_do_not_depend_on_the_batch_beside_them(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 96, generator=g).to(dtype)
    pw = L.prepack(torch.randn(160, 96, generator=g).to(dtype))
    full = L.linear(x, pw)
    for rows in (1, 2, 5, 64):
        assert torch.equal(L.linear(x[:rows], pw), full[:rows])


def test_prepack_leaves_other_tensors_alone():
    v = torch.randn(8)
    assert L.prepack(v) is v
    i = torch.ones(4, 4, dtype=torch.int8)
    assert L.prepack(i) is i


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_logits_unchanged_by_packing(dtype, tiny_llama_dir, monkeypatch):
    packed = our_logits(tiny_llama_dir, IDS, dtype)
    monkeypatch.setattr(weights_module, "prepack", L._identity)
    monkeypatch.setattr(head_module, "prepack", L._identity)
    plain = our_logits(tiny_llama_dir, IDS, dtype)
    if dtype == torch.bfloat16 and _onednn_uses_amx():
        # On a CPU with AMX, oneDNN's packed bfloat16 GEMM runs on AMX tiles, which sum in
        # another order than the plain path: measured on a Xeon with amx_bf16, 6 of 61,440
        # logits one bfloat16 step apart, the same greedy tokens (and bit for bit equal with
        # ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16). Elsewhere packing changes no bit.
        assert torch.equal(packed.argmax(-1), plain.argmax(-1))
        torch.testing.assert_close(packed, plain, rtol=2 ** -7, atol=2 ** -9)
        assert (packed != plain).float().mean() < 0.01
    else:
        assert torch.equal(packed, plain)


def _onednn_uses_amx() -> bool:
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return "amx_bf16" in cpu_info().flags and (not capped or "AMX" in capped
                                               or capped in ("ALL", "DEFAULT"))


@pytest.mark.skipif(L.prepack is L._prepack_onednn, reason="the few-row kernel does not run here")
def test_linear_takes_the_kernel_for_few_rows_and_onednn_beyond(monkeypatch):
    # gemm_bf16's range as on a CPU without AMX (on one with it, oneDNN takes those rows)
    monkeypatch.setattr(L, "BF16_KERNEL_MAX_ROWS", L.BF16_KERNEL_MAX_ROWS_AVX512)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(200, 96, generator=g).bfloat16()
    up = torch.randn(200, 96, generator=g).bfloat16()
    pw = L.prepack(w)
    assert isinstance(pw, L.PackedWeight)
    gate_pair, pup = L.prepack_gate_up(w, up)
    x = torch.randn(L.BF16_KERNEL_MAX_ROWS + 1, 96, generator=g).bfloat16()
    few = x[:L.GEMV_MAX_ROWS]
    assert torch.equal(L.linear(few, pw), pw.gemv(few))
    assert torch.equal(L.silu_mul(few, gate_pair, pup), gate_pair.gemv.silu_mul(few))
    # up to BF16_KERNEL_MAX_ROWS rows: gemm_bf16, which gives each row the few-row kernel's
    # result (a row's result does not depend on the rows beside it)
    many = x[:L.BF16_KERNEL_MAX_ROWS]
    by_eight = torch.cat([pw.gemv(many[i:i + 8]) for i in range(0, len(many), 8)])
    assert torch.equal(L.linear(many, pw), by_eight)
    assert torch.equal(L.silu_mul(many, gate_pair, pup), torch.cat(
        [gate_pair.gemv.silu_mul(many[i:i + 8]) for i in range(0, len(many), 8)]))
    assert torch.equal(L.linear(x, pw), L.linear(x, pw.onednn))
    monkeypatch.setattr(L, "BF16_KERNEL_MAX_ROWS", 0)
    assert torch.equal(L.linear(many, pw), L.linear(many, pw.onednn))
    monkeypatch.setattr(L, "GEMV_MAX_ROWS", 0)  # both off: oneDNN at every row count
    assert torch.equal(L.linear(few, pw), L.linear(few, pw.onednn))
    torch.testing.assert_close(L.linear(few, pw).float(), few.float() @ w.float().T,
                               rtol=2e-2, atol=1e-3)


@pytest.mark.skipif(L.prepack is L._prepack_onednn, reason="the few-row kernel does not run here")
def test_tiny_model_greedy_decode_unchanged_by_the_kernel(tiny_llama_dir, monkeypatch):
    """bfloat16 greedy decoding (one and three requests: 1-3 rows per step, the kernel's
    range) gives the tokens oneDNN gives."""
    from tests.executor.exactness_helpers import add_greedy, make_engine, random_prompts, run_all
    prompts = random_prompts(3, 3, 60, seed=1)

    def greedy(batch: list[list[int]]) -> list[list[int]]:
        core = make_engine(tiny_llama_dir, dtype="bfloat16")
        add_greedy(core, batch, 24)
        out = run_all(core)
        return [out[str(i)] for i in range(len(batch))]

    with_kernel = greedy(prompts), greedy(prompts[:1])
    monkeypatch.setattr(L, "GEMV_MAX_ROWS", 0)
    monkeypatch.setattr(L, "BF16_KERNEL_MAX_ROWS", 0)
    assert (greedy(prompts), greedy(prompts[:1])) == with_kernel



@pytest.mark.skipif(L.prepack is L._prepack_onednn, reason="the few-row kernel does not run here")
def test_bf16_kernel_rows_leave_amx_cpus_to_onednn():
    """Where the CPU has AMX, oneDNN's bfloat16 GEMM (on the tiles) takes every product above
    the few-row kernel's rows; with AVX512-BF16 alone, gemm_bf16 takes them up to 256."""
    assert L.bf16_kernel_max_rows(frozenset({"avx512_bf16", "amx_bf16", "amx_tile"})) == 0
    assert L.bf16_kernel_max_rows(frozenset({"avx512_bf16", "avx512f"})) == 256
    assert L.BF16_KERNEL_MAX_ROWS == L.bf16_kernel_max_rows(cpu_info().flags)


def test_tiny_model_bf16_results_do_not_depend_on_the_batch(tiny_llama_dir, monkeypatch):
    """bfloat16 greedy decoding of 12 requests together (9-12 rows per decode step: gemm_bf16,
    in its range as on a CPU without AMX) gives each request the tokens and the
    log-probabilities, to the bit, that it gets alone (one row per step: the few-row kernel),
    as both kernels sum a row alike."""
    monkeypatch.setattr(L, "BF16_KERNEL_MAX_ROWS", L.BF16_KERNEL_MAX_ROWS_AVX512)
    from llmtower.core.outputs import EngineCoreRequest
    from llmtower.core.sampling_params import SamplingParams
    from tests.executor.exactness_helpers import make_engine, random_prompts
    prompts = random_prompts(12, 3, 16, seed=2)

    def greedy(batch: list[list[int]]) -> list[list[tuple[int, float]]]:
        core = make_engine(tiny_llama_dir, dtype="bfloat16")
        for i, p in enumerate(batch):
            core.add_request(EngineCoreRequest(str(i), p, SamplingParams(
                temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)))
        out: dict[str, list[tuple[int, float]]] = {}
        while core.has_unfinished_requests():
            for o in core.step().outputs:
                out.setdefault(o.request_id, []).extend(
                    (e[0], e[1]) for e in o.new_logprobs or [])
        return [out[str(i)] for i in range(len(batch))]

    together = greedy(prompts)
    assert all(len(r) == 12 for r in together)
    # (the prefills too: 12 x <= 16 rows together, <= 16 alone, all within the kernels' range;
    # on this tiny model oneDNN happens to sum alike as well, SmolLM2's shapes are where it
    # differs: tests/kernels/test_gemm_bf16.py checks the kernel itself)
    assert together == [greedy([p])[0] for p in prompts]
