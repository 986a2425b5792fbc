"""The block-quantized kernels (kernels/quant_gemm.c, quant_gemm_k.c): dequantized weights equal
gguf's reference dequantization exactly, and products equal the float product of those weights
up to the int8 rounding of the activations (per 32 values, or per 256 for the K formats), on
the fast and the portable code alike."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmtower.kernels import ops
from llmtower.kernels.quant_gemm import (BLOCK_FORMATS, K_FORMATS, BlockWeight, block_shape,
                                         from_numpy, quantize_activations)

Q = gguf.GGMLQuantizationType
FORMATS = [Q(f) for f in BLOCK_FORMATS]
# Offsets of the float16 fields inside one block (the rest are integers, any bytes valid).
_HALVES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
           Q.Q6_K: (208,)}
PATHS = [0, 1] if ops.capabilities().can_run("quant_gemm") else [1]


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row_bytes] uint8 of random valid blocks: random integers and scales of 1e-3 .. 1e-1
    (signed where the format's scale is: Q4_1's and the K formats' minimums too)."""
    rng = np.random.default_rng(seed)
    values, nbytes = block_shape(int(qtype))
    nblocks = n * k // values
    blocks = rng.integers(0, 256, (nblocks, nbytes), dtype=np.uint8)
    for off in _HALVES[qtype]:
        scale = (rng.uniform(1e-3, 1e-1, nblocks) * rng.choice([-1, 1], nblocks)).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(nblocks, 2)
    return blocks.reshape(n, k // values * nbytes)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_dequantize_equals_gguf_reference_exactly(qtype):
    n, k = 7, 512
    data = random_blocks(qtype, n, k)
    want = gguf.quants.dequantize(data, qtype)
    w = from_numpy(int(qtype), data, n, k)
    got = w.dequantize().numpy()
    assert got.shape == want.shape == (n, k)
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    rows = torch.tensor([6, 0, 3, 3])
    np.testing.assert_array_equal(w.dequantize(rows).numpy(), want[[6, 0, 3, 3]])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 6, 16])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_product_matches_float_product_of_dequantized(qtype, m, path):
    n, k = 40, 768
    data = random_blocks(qtype, n, k, seed=m)
    w = from_numpy(int(qtype), data, n, k, path=path)
    wf = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float64))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = w(x).double()
    want = x.double() @ wf.T
    # Each activation moves by at most half an int8 step of its block (max|x| / 254; blocks of
    # 256 for the K formats, 32 for the others): bound the product's error by that times the
    # weights' absolute sums, per block.
    blk = 256 if int(qtype) in K_FORMATS else 32
    step = x.view(m, k // blk, blk).abs().amax(-1).double() / 254
    bound = (step.repeat_interleave(blk, dim=1) @ wf.abs().T) * 1.01 + 1e-4
    assert ((got - want).abs() <= bound).all()
    # And not just inside the bound: far closer than the weights' own size.
    assert (got - want).abs().mean() < 0.05 * want.abs().mean()


@pytest.mark.parametrize("m", [4, 5, 9, 17])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_many_row_products_agree_with_portable_code_across_tile_edges(qtype, m):
    """The fast code's groups of 16 weight rows (quant_gemm_16.c, quant_gemm_k16.c) over row
    counts around their tiles (the K formats from 5 rows of x, 8 rows per pass, 9+ in Q4_0 /
    Q8_0's chunked form), a K of 5 super-blocks / 40 blocks (past a chunk of 4 / 32), and 40
    weight rows (two groups and 8 rows left to the one-row code): the portable code's sums up
    to float rounding, and inside the int8 bound of the float product."""
    if 0 not in PATHS:
        pytest.skip("the fast code is not built here")
    n, k = 40, 1280
    data = random_blocks(qtype, n, k, seed=m + 7)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 7))
    fast = from_numpy(int(qtype), data, n, k, path=0)(x).double()
    portable = from_numpy(int(qtype), data, n, k, path=1)(x).double()
    scale = portable.abs().mean()
    assert (fast - portable).abs().max() < 1e-5 * scale
    if int(qtype) in K_FORMATS:  # the one-weight-row fast code alike (path 2)
        one_row = from_numpy(int(qtype), data, n, k, path=2)(x).double()
        assert (fast - one_row).abs().max() < 1e-5 * scale
    wf = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float64))
    blk = 256 if int(qtype) in K_FORMATS else 32
    step = x.view(m, k // blk, blk).abs().amax(-1).double() / 254
    bound = (step.repeat_interleave(blk, dim=1) @ wf.abs().T) * 1.01 + 1e-4
    assert ((fast - x.double() @ wf.T).abs() <= bound).all()


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_prefill_chunks_over_several_panels_agree_with_portable_code(qtype):
    """A prefill chunk whose activations overflow L1 (12 rows of k = 4096) on the AVX2 / NEON
    code takes the weight rows a panel at a time (quant_blocks.h PANEL_BYTES: Q4_0 56 rows of
    4096, the K formats 28, so 70 rows make two or three panels, the last one short), each 4 or
    8 rows of x over the whole panel: the portable code's sums up to float rounding."""
    if 0 not in PATHS:
        pytest.skip("the fast code is not built here")
    n, k, m = 70, 4096, 12
    data = random_blocks(qtype, n, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    fast = from_numpy(int(qtype), data, n, k, path=0)(x).double()
    portable = from_numpy(int(qtype), data, n, k, path=1)(x).double()
    assert (fast - portable).abs().max() < 1e-5 * portable.abs().mean()


@pytest.mark.parametrize("k", [256, 416, 1312])  # 8 blocks, 8 + 5, 5 x 8 + 1
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
def test_one_row_products_over_eight_block_runs_and_their_tails(qtype, k):
    """A decode's product by Q4_0 / Q8_0 (AVX2: eight blocks at a time, the blocks past them
    one by one): the portable code's sums up to float rounding, with a row count (37) that
    is not a multiple of the four-row code's."""
    if 0 not in PATHS:
        pytest.skip("the fast code is not built here")
    data = random_blocks(qtype, 37, k, seed=k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k))
    fast = from_numpy(int(qtype), data, 37, k, path=0)(x).double()
    portable = from_numpy(int(qtype), data, 37, k, path=1)(x).double()
    assert (fast - portable).abs().max() < 1e-5 * portable.abs().mean()


def test_q8_0_extremes_sum_exactly():
    """Q8_0's worst case for a dot of byte pairs summed in int16 (vpmaddubsw, the AVX2 code's
    step without VNNI): weights of -128 and 127 against activations of +-127, whose pair sums
    as w + 128 would saturate. Integer-valued scales and activations make every sum exact, so
    the fast and portable code give the float64 product to the last bit."""
    if 0 not in PATHS:
        pytest.skip("the fast code is not built here")
    n, k = 16, 256
    rng = np.random.default_rng(5)
    blocks = np.zeros((n * k // 32, 34), np.uint8)
    blocks[:, 0:2] = np.full(n * k // 32, 1.0, np.float16).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = rng.choice(np.array([-128, 127, -127, 0], np.int8), (n * k // 32, 32)).view(np.uint8)
    data = blocks.reshape(n, -1)
    x = torch.from_numpy(rng.choice([-127.0, 127.0], (3, k)).astype(np.float32))
    want = x.double() @ torch.from_numpy(gguf.quants.dequantize(data, Q.Q8_0).astype(np.float64)).T
    for path in PATHS:
        got = from_numpy(int(Q.Q8_0), data, n, k, path=path)(x).double()
        assert torch.equal(got, want), path


def test_k_activations_are_int8_per_256_with_sums_of_16():
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2)) * 3
    x[1, :256] = 0.0  # an all-zero block: scale 0, values 0
    f = quantize_activations(x).per256()
    amax = x.view(3, 2, 256).abs().amax(-1)
    torch.testing.assert_close(f.da.view(3, 2), amax / 127, rtol=0, atol=0)
    safe = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    want = torch.round(x.view(3, 2, 256) * safe.unsqueeze(-1)).view(3, 512)  # half to even
    assert torch.equal(f.qa.view(3, 512).float(), want)
    assert torch.equal(f.bs.view(3, 32).int(), want.view(3, 32, 16).sum(-1).int())
    assert int(f.qa.abs().max()) <= 127
    # Q4_K / Q5_K's form: each 256's sub-blocks of 32 in their nibble order, sums alike
    n = quantize_activations(x).per256(nibble_order=True)
    order = [0, 2, 1, 3, 4, 6, 5, 7]
    assert torch.equal(n.qa.view(3, 2, 8, 32), f.qa.view(3, 2, 8, 32)[:, :, order])
    assert torch.equal(n.bs.view(3, 2, 8, 2), f.bs.view(3, 2, 8, 2)[:, :, order])
    assert torch.equal(n.da, f.da)
    with pytest.raises(ValueError, match="multiples of 256"):
        quantize_activations(torch.zeros(1, 96)).per256()


@pytest.mark.parametrize("m", [3, 70])  # from 64 rows the rows are shared out to threads
def test_activations_are_int8_per_32_with_their_sums(m):
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)) * 3
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, values 0
    f = quantize_activations(x).per32()
    amax = x.view(m, 3, 32).abs().amax(-1)
    torch.testing.assert_close(f.da.view(m, 3), amax / 127, rtol=0, atol=0)
    safe = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    want = torch.round(x.view(m, 3, 32) * safe.unsqueeze(-1))  # half to even
    assert torch.equal(f.qa.view(m, 3, 32).float(), want)
    sums = want.view(m, 3, 2, 16).sum(-1)
    ns = f.ns.view(m, 3, 8)
    assert torch.equal(ns[..., 0].float(), -sums[..., 0]) and torch.equal(ns[..., 4].float(), -sums[..., 1])
    assert not ns[..., [1, 2, 3, 5, 6, 7]].any()
    torch.testing.assert_close(f.fa.view(m, 3), f.da.view(m, 3) * sums.sum(-1), rtol=0, atol=0)


def test_fast_and_portable_agree():
    if 0 not in PATHS or 1 not in PATHS:
        pytest.skip("the fast code is not built here")
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    for qtype in FORMATS:
        data = random_blocks(qtype, 24, 512, seed=3)
        a = from_numpy(int(qtype), data, 24, 512, path=0)(x)
        b = from_numpy(int(qtype), data, 24, 512, path=1)(x)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="no block kernel"):
        block_shape(int(Q.IQ2_XXS))
    with pytest.raises(ValueError, match="multiples of 256"):
        BlockWeight(int(Q.Q4_K), torch.zeros(144, dtype=torch.uint8), 1, 128)
    w = from_numpy(int(Q.Q8_0), random_blocks(Q.Q8_0, 2, 64), 2, 64)
    with pytest.raises(ValueError, match="cannot multiply"):
        w(torch.zeros(1, 96))
    with pytest.raises(IndexError):
        w.dequantize(torch.tensor([2]))
