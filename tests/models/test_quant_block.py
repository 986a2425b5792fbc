"""BlockQuantLinear's many-row product (a prefill chunk): the weight dequantized a slab of rows
at a time gives the product of the whole dequantized weight, across parts of different block
formats, without a float copy of the whole weight."""
from __future__ import annotations

import gguf
import pytest
import torch

from llmtower.kernels import ops
from llmtower.kernels.quant_gemm import from_numpy
from llmtower.models import quant_block
from llmtower.models.linear import linear
from llmtower.models.quant_block import BLOCK_KERNEL_MAX_ROWS, BlockQuantLinear
from tests.kernels.test_quant_gemm import random_blocks

Q = gguf.GGMLQuantizationType


def test_many_rows_take_the_weight_a_slab_at_a_time(monkeypatch):
    if not ops.capabilities().can_run("quant_gemm"):
        pytest.skip(ops.capabilities().why_not("quant_gemm"))
    k = 256
    parts = [from_numpy(int(Q.Q4_0), random_blocks(Q.Q4_0, 200, k, seed=1), 200, k),
             from_numpy(int(Q.Q6_K), random_blocks(Q.Q6_K, 72, k, seed=2), 72, k)]
    layer = BlockQuantLinear(parts)
    x = torch.randn(BLOCK_KERNEL_MAX_ROWS + 9, k, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(layer.out_features)
    whole = torch.cat([p.dequantize() for p in parts]).to(torch.bfloat16)
    want = linear(x.to(torch.bfloat16), whole).float() + bias

    slabs: list[int] = []
    real_rows = type(parts[0]).rows

    def counted_rows(self, start, end):
        slabs.append(end - start)
        return real_rows(self, start, end)

    monkeypatch.setattr(type(parts[0]), "rows", counted_rows)
    monkeypatch.setattr(quant_block, "_has_amx", lambda: True)  # every format's limit: 96 rows
    monkeypatch.setattr(quant_block, "DEQUANT_SLAB_BYTES", 64 * 2 * k)  # 64 rows a slab
    monkeypatch.setattr(quant_block, "DEQUANT_SLAB_MIN_ROWS", 16)
    got = layer(x, bias)
    assert slabs == [64, 64, 64, 8, 64, 8]  # never more than a slab's rows dequantized at once
    assert got.shape == (x.shape[0], 272) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bfloat16 products' rounding
    # the slab boundaries are invisible: every column equals a one-slab product's
    monkeypatch.setattr(quant_block, "DEQUANT_SLAB_BYTES", 10**9)
    torch.testing.assert_close(layer(x, bias), got, rtol=1e-2, atol=1e-2)


def test_without_amx_each_format_keeps_the_int8_kernel_up_to_its_own_row_limit(monkeypatch):
    """Without AMX a whole 512-row GGUF prefill chunk stays on the int8 kernel for Q4_0 and the
    K formats (their 16-weight-row code), and at 200 rows a Q6_K part keeps it while a Q4_1
    part beside it (not measured: the AMX limit) takes bfloat16 slabs."""
    if not ops.capabilities().can_run("quant_gemm"):
        pytest.skip(ops.capabilities().why_not("quant_gemm"))
    monkeypatch.setattr(quant_block, "_has_amx", lambda: False)
    for q in (Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        assert quant_block.int8_max_rows(int(q)) >= 512
    assert quant_block.int8_max_rows(int(Q.Q4_1)) < 200 <= quant_block.int8_max_rows(int(Q.Q6_K))
    k = 256
    parts = [from_numpy(int(Q.Q6_K), random_blocks(Q.Q6_K, 48, k, seed=1), 48, k),
             from_numpy(int(Q.Q4_1), random_blocks(Q.Q4_1, 32, k, seed=2), 32, k)]
    layer = BlockQuantLinear(parts)
    x = torch.randn(200, k, generator=torch.Generator().manual_seed(0))
    got = layer(x)
    assert torch.equal(got[:, :48], parts[0](x))  # the int8 kernel's own result
    want = linear(x.to(torch.bfloat16), parts[1].dequantize().to(torch.bfloat16)).float()
    torch.testing.assert_close(got[:, 48:], want)  # the bfloat16 product
    assert not torch.equal(got[:, 48:], parts[1](x))
    assert torch.equal(layer(x[:90]), torch.cat([p(x[:90]) for p in parts], 1))


def test_without_a_fast_bfloat16_gemm_every_chunk_keeps_the_int8_kernel(monkeypatch):
    """On an AVX2-only CPU (no bfloat16 GEMM in oneDNN; PyTorch's takes 4-6x float32's time)
    no row count goes to bfloat16 slabs, even where AMX's limit would: a 600-row chunk's
    Q4_1 and Q6_K parts are the int8 kernel's own results."""
    if not ops.capabilities().can_run("quant_gemm"):
        pytest.skip(ops.capabilities().why_not("quant_gemm"))
    monkeypatch.setattr(quant_block.linear_ops, "BF16_FAST", False)
    monkeypatch.setattr(quant_block, "_has_amx", lambda: True)
    k = 256
    parts = [from_numpy(int(Q.Q6_K), random_blocks(Q.Q6_K, 48, k, seed=1), 48, k),
             from_numpy(int(Q.Q4_1), random_blocks(Q.Q4_1, 32, k, seed=2), 32, k)]
    x = torch.randn(600, k, generator=torch.Generator().manual_seed(0))
    got = BlockQuantLinear(parts)(x)
    assert torch.equal(got, torch.cat([p(x) for p in parts], 1))


def test_a_slab_is_a_view_of_the_rows():
    data = random_blocks(Q.Q8_0, 10, 64, seed=3)
    w = from_numpy(int(Q.Q8_0), data, 10, 64)
    assert torch.equal(w.rows(3, 7).dequantize(), w.dequantize()[3:7])
    assert w.rows(3, 7).data.data_ptr() == w.data.data_ptr() + 3 * w.row_bytes
    with pytest.raises(IndexError):
        w.rows(5, 11)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K],
                         ids=lambda q: q.name)
def test_bfloat16_dequantization_is_the_float32_values_rounded(qtype):
    if not ops.capabilities().can_run("quant_gemm"):
        pytest.skip(ops.capabilities().why_not("quant_gemm"))
    w = from_numpy(int(qtype), random_blocks(qtype, 37, 512, seed=4), 37, 512)
    assert torch.equal(w.dequantize(dtype=torch.bfloat16), w.dequantize().to(torch.bfloat16))
    idx = torch.tensor([36, 0, 5])
    assert torch.equal(w.dequantize(idx, torch.bfloat16), w.dequantize(idx).to(torch.bfloat16))
