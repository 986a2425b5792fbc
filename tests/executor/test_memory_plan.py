"""The start's memory plan: weights estimated from the files (a GGUF's blocks as they are with
--quantization gguf, dequantized otherwise), and a plan past the available memory refused with
the numbers and what to change."""
from __future__ import annotations

import gguf
import pytest
import torch

from llmtower.executor.memory_plan import MemoryPlan, estimate_weight_bytes, rss_bytes
from llmtower.kernels import ops
from tests.fixtures.tiny_gguf import write_gguf_from_hf_dir

GIB = 2**30


def test_plan_that_does_not_fit_is_refused_with_numbers():
    plan = MemoryPlan(weights=6 * GIB, working=GIB // 2, kv_cache=4 * GIB, swap=0,
                      available=8 * GIB)
    with pytest.raises(ValueError) as e:
        plan.check()
    msg = str(e.value)
    assert "weights 6.00 GiB" in msg and "KV cache 4.00 GiB" in msg and "available: 8.00 GiB" in msg
    assert "3.30 GiB must go" in msg and "--kv-cache-memory" in msg and "--quantization gguf" in msg
    MemoryPlan(6 * GIB, GIB // 2, GIB // 2, 0, 8 * GIB).check()  # 7.0 <= 0.9 * 8
    MemoryPlan(60 * GIB, 0, 0, 0, None).check()  # unknown: nothing to check against


def test_gguf_weights_estimated_from_the_tensor_table(tmp_path, tiny_llama_dir):
    q = gguf.GGMLQuantizationType
    path = write_gguf_from_hf_dir(tiny_llama_dir, tmp_path / "q8.gguf",
                                  qtype_of=lambda _name, _w: q.Q8_0)
    reader = gguf.GGUFReader(str(path))
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    vectors = [t for t in reader.tensors if len(t.shape) != 2]
    block = estimate_weight_bytes(tmp_path, path, torch.float32, "gguf")
    if ops.capabilities().can_run("quant_gemm"):  # blocks kept: the file's bytes
        assert block == sum(int(t.n_bytes) for t in matrices) + sum(4 * int(t.n_elements)
                                                                    for t in vectors)
    dense = estimate_weight_bytes(tmp_path, path, torch.bfloat16, "none")
    assert dense >= 2 * sum(int(t.n_elements) for t in reader.tensors)
    assert dense > block


def test_rss_is_measured():
    rss, peak = rss_bytes()
    assert 0 < rss <= peak
