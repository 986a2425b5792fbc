"""Streamed memory on transparent huge pages (``kernels/huge_pages.py``): tensors carved from
advised mappings are 2 MiB-eligible, never overlap, outlive the arena's references, and change
no result: an engine built with huge pages off gives the same logits bit for bit."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from llmtower.executor import model_runner
from llmtower.kernels import huge_pages as hp
from llmtower.models import llama
from tests.executor.exactness_helpers import add_greedy, make_engine, random_prompts, run_all
from tests.fixtures.tiny_models import (  # noqa: F401  (pytest finds fixtures by name)
    tiny_llama_dir,
    tiny_tokenizer_dir,
)


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[")[1].split("]")[0]


needs_thp = pytest.mark.skipif(not sys.platform.startswith("linux")
                               or _thp_mode() not in ("always", "madvise"),
                               reason="no transparent huge pages on this system")


def _vma_flags(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address ``ptr``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(a, 16) for a in head.split("-"))
            if inside:
                break
            inside = lo <= ptr < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@needs_thp
def test_arena_tensors_sit_on_huge_page_eligible_memory(monkeypatch):
    monkeypatch.setattr(hp, "ENABLED", True)
    arena = hp.HugePageArena(chunk_bytes=8 * 2**20)
    a = arena.empty(3 * 2**20 // 2, torch.bfloat16)  # 3 MiB: more than a quarter chunk
    b = arena.empty(100_000, torch.float32)
    c = arena.empty(100_000, torch.float32)
    for t in (a, b, c):
        assert _vma_flags(t.data_ptr()).get("THPeligible") == "1"
    # The own mapping of a large tensor starts on a 2 MiB boundary; small ones pack behind
    # each other on 4 KiB boundaries without overlapping.
    assert a.data_ptr() % hp.HUGE_PAGE == 0
    assert c.data_ptr() >= b.data_ptr() + b.nbytes and c.data_ptr() % 4096 == 0


def test_plain_torch_memory_is_not_advised_but_the_arena_is(monkeypatch):
    """The check above can fail: ordinary tensors are not eligible in madvise mode."""
    if _thp_mode() != "madvise":
        pytest.skip("the system's THP mode is not madvise")
    plain = torch.empty(3 * 2**20, dtype=torch.uint8)
    assert _vma_flags(plain.data_ptr()).get("THPeligible") == "0"
    monkeypatch.setattr(hp, "ENABLED", True)
    assert _vma_flags(hp.empty_streamed(3 * 2**20, torch.uint8).data_ptr()).get(
        "THPeligible") == "1"


def test_tensors_keep_their_chunk_alive_and_hold_what_was_written(monkeypatch):
    monkeypatch.setattr(hp, "ENABLED", True)
    arena = hp.HugePageArena(chunk_bytes=4 * 2**20)
    kept = [arena.empty(200_000, torch.float32) for _ in range(12)]  # spans several chunks
    for i, t in enumerate(kept):
        t.fill_(float(i))
    del arena
    gc.collect()
    assert [float(t[0]) for t in kept] == [float(i) for i in range(12)]
    assert [float(t[-1]) for t in kept] == [float(i) for i in range(12)]


def test_copies_are_equal_and_off_means_plain_tensors(monkeypatch):
    monkeypatch.setattr(hp, "ENABLED", True)
    w = torch.randn(300, 257)
    h = hp.to_huge_pages(w)
    assert h.data_ptr() != w.data_ptr() and torch.equal(h, w) and h.is_contiguous()
    small = torch.randn(10)
    assert hp.to_huge_pages(small) is small
    assert hp.to_huge_pages(w.to_mkldnn()).is_mkldnn  # opaque layouts stay as they are
    monkeypatch.setattr(hp, "ENABLED", False)
    assert hp.to_huge_pages(w) is w
    e = hp.empty_on_huge_pages((4, 300, 257), torch.float32)
    assert e.shape == (4, 300, 257) and e.dtype == torch.float32
    assert hp.empty_streamed(0, torch.float32).numel() == 0


@pytest.mark.skipif(hp.huge_page_bytes() is None, reason="no /proc/self/smaps_rollup")
def test_huge_page_bytes_reads_this_process():
    assert hp.huge_page_bytes() >= 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_results_do_not_depend_on_the_pages(tiny_llama_dir, monkeypatch, dtype):
    """Every weight and the KV cache on arena memory (threshold 0) against plain tensors:
    the same greedy tokens and logits, bit for bit."""
    real = llama.LlamaForCausalLM._logits
    runs = []
    for enabled in (False, True):
        logits: list[torch.Tensor] = []

        def record(self, x, logits=logits):
            out = real(self, x)
            logits.append(out.clone())
            return out

        monkeypatch.setattr(llama.LlamaForCausalLM, "_logits", record)
        monkeypatch.setattr(model_runner, "GREEDY_SCREEN", False)  # every step's logits
        monkeypatch.setattr(hp, "ENABLED", enabled)
        monkeypatch.setattr(hp, "MIN_BYTES", 0)
        core = make_engine(tiny_llama_dir, dtype=dtype, num_threads=2)
        add_greedy(core, random_prompts(5, 3, 30, seed=1), 10)
        runs.append((run_all(core), logits))
    (tok_off, log_off), (tok_on, log_on) = runs
    assert tok_on == tok_off
    assert len(log_on) == len(log_off) > 0
    assert all(torch.equal(a, b) for a, b in zip(log_on, log_off))
