"""This machine's DRAM read bandwidth against the decode step's effective bandwidth.

A one-row bfloat16 decode step must read every weight once (~270 MB on SmolLM2-135M) plus
the KV of its context, so the weight-read floor of a step is bytes / DRAM read bandwidth.
This script measures both sides, in one process, taking turns so that the VM's memory-speed
phases hit both alike:

  * the probe, on ordinary 4 KiB pages and on the huge pages the engine's weights and KV
    cache get (kernels/huge_pages.py; the decode ratio is taken against the latter): a C streaming read (AVX-512 / AVX2 loads summed into vector registers, no
    stores) over a buffer much larger than the L3 cache, with 1 and 2 OpenMP threads; numpy's
    ``sum`` over the same buffer as a fallback where there is no C compiler;
  * the decode step: a one-stream greedy request through the real EngineCore (bfloat16), each
    decode step's wall time; bytes = the weights a one-row step reads (config-derived: every
    linear weight once, the embedding's one row) + its K and V up to its position.

    chrt -f 1 .venv/bin/python benchmarks/memory_bandwidth.py
    chrt -f 1 .venv/bin/python benchmarks/memory_bandwidth.py --rounds 5 --buffer-mib 512

The ratio printed last is (decode effective GB/s) / (probe GB/s with the engine's thread
count): 1.0 would be a step that only streams its weights at the machine's read speed.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from llmtower.kernels.huge_pages import huge_page_bytes

PROBE_C = r"""
#include <stddef.h>
#include <stdint.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define VEC __m512i
#define W 64
#define LOAD(p) _mm512_load_si512((const void *)(p))
#define ADD(a, b) _mm512_add_epi64(a, b)
#define ZERO() _mm512_setzero_si512()
#define SUM(v) _mm512_reduce_add_epi64(v)
#elif defined(__AVX2__)
#include <immintrin.h>
#define VEC __m256i
#define W 32
#define LOAD(p) _mm256_load_si256((const __m256i *)(p))
#define ADD(a, b) _mm256_add_epi64(a, b)
#define ZERO() _mm256_setzero_si256()
static int64_t SUM(__m256i v) { int64_t t[4]; _mm256_storeu_si256((__m256i *)t, v);
                                return t[0] + t[1] + t[2] + t[3]; }
#else
#define W 8
#endif

/* Sum of the buffer as int64 words, read by `threads` threads in contiguous slices (like the
   decode kernels split a weight matrix's rows). n: bytes, a multiple of 4 * W * threads.
   nta > 0: each line is first prefetched `nta` bytes ahead with the non-temporal hint
   (prefetchnta on x86), which keeps the stream from evicting the caches' other contents. */
int64_t read_sum(const uint8_t *buf, size_t n, int threads, long nta) {
    int64_t total = 0;
    #pragma omp parallel num_threads(threads) reduction(+:total)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        size_t per = n / nt / (4 * W) * (4 * W);
        const uint8_t *p = buf + per * t, *end = p + per;
#if W > 8
        VEC a = ZERO(), b = ZERO(), c = ZERO(), d = ZERO();
        for (; p < end; p += 4 * W) {
            if (nta)
                for (int l = 0; l < 4 * W; l += 64) __builtin_prefetch(p + nta + l, 0, 0);
            a = ADD(a, LOAD(p)); b = ADD(b, LOAD(p + W));
            c = ADD(c, LOAD(p + 2 * W)); d = ADD(d, LOAD(p + 3 * W));
        }
        total += SUM(ADD(ADD(a, b), ADD(c, d)));
#else
        for (; p < end; p += 8) total += *(const int64_t *)p;
#endif
    }
    return total;
}
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--buffer-mib", type=int, default=256,
                   help="probe buffer (well above the L3 cache; ~the bf16 weights' size)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--input-len", type=int, default=144)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2,
                   help="engine threads (vs_vllm.sh's 2); 0: the engine's default, which "
                        "takes fewer under contention")
    p.add_argument("--no-engine", action="store_true", help="the probe only")
    return p.parse_args()


def build_probe() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return None
    d = Path(tempfile.mkdtemp(prefix="llmtower_bw_"))
    src, lib = d / "probe.c", d / "probe.so"
    src.write_text(PROBE_C)
    for flags in (["-march=native"], []):
        r = subprocess.run([cc, "-O3", "-fopenmp", "-fPIC", "-shared", *flags, str(src), "-o",
                            str(lib)], capture_output=True, text=True)
        if r.returncode == 0:
            so = ctypes.CDLL(str(lib))
            so.read_sum.restype = ctypes.c_int64
            so.read_sum.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                    ctypes.c_long]
            return so
    return None


class Probe:
    """A streaming read over ``mib`` MiB: on huge pages where the engine's weights get them
    (kernels/huge_pages.py), or (``huge=False``) on ordinary 4 KiB pages."""

    def __init__(self, mib: int, huge: bool = True, lib: ctypes.CDLL | None = None) -> None:
        self.n = mib * 2**20
        if huge:
            from llmtower.kernels.huge_pages import empty_on_huge_pages
            import torch
            self.buf = empty_on_huge_pages((self.n,), torch.uint8).numpy()
            self.buf[:] = 1  # touched: no page faults in the timing
        else:
            # numpy advises its own large arrays for huge pages: off for this one.
            from numpy._core.multiarray import _set_madvise_hugepage
            was = _set_madvise_hugepage(False)
            raw = np.ones(self.n + 4096, dtype=np.uint8)
            _set_madvise_hugepage(was)
            off = (-raw.ctypes.data) % 4096
            self.buf = raw[off:off + self.n]
        self.lib = lib if lib is not None else build_probe()

    def gbps(self, threads: int, reps: int = 3, nta: int = 0) -> float:
        """Best of ``reps`` full passes, GB/s (1e9 bytes)."""
        best = float("inf")
        for _ in range(reps):
            best = min(best, self.one_pass(threads, nta))
        return self.n / best / 1e9

    def one_pass(self, threads: int, nta: int = 0) -> float:
        t = time.perf_counter()
        if self.lib is not None:
            self.lib.read_sum(self.buf.ctypes.data, self.n, threads, nta)
        else:
            self.buf.view(np.int64).sum()
        return time.perf_counter() - t


def host_work() -> Callable[[], object]:
    """A step's host-side work in miniature (numpy gathers, torch.from_numpy, a greedy argmax
    over a vocabulary row, a dict): what the runner does between two forward passes."""
    import torch

    table = np.zeros((64, 40), dtype=np.int64)
    tokens = np.zeros((64, 512), dtype=np.int32)
    logits = torch.randn(1, 49152)

    def work() -> object:
        rows = np.fromiter(range(1), dtype=np.int64, count=1)
        slots = table[rows, rows] * 16 + rows % 16
        ids = tokens[rows, rows].astype(np.int64)
        parts = {"slots": torch.from_numpy(slots), "ids": torch.from_numpy(ids),
                 "next": np.argmax(logits.numpy(), axis=-1)}
        return sorted(parts)

    return work


def cache_pollution(probe: Probe, threads: int, nta: int, rounds: int = 15
                    ) -> tuple[float, float, float]:
    """(GB/s, host work right after a stream in us, the same work hot in us), medians."""
    work = host_work()
    bw, after, hot = [], [], []
    for _ in range(rounds):
        bw.append(probe.n / probe.one_pass(threads, nta) / 1e9)
        t = time.perf_counter()
        work()
        after.append(time.perf_counter() - t)
        t = time.perf_counter()
        work()
        hot.append(time.perf_counter() - t)
    return (statistics.median(bw), statistics.median(after) * 1e6,
            statistics.median(hot) * 1e6)


def step_bytes(cfg, position: int, elem: int) -> int:
    """Bytes a one-row decode step must read: every linear weight once, one embedding row,
    the norms, and K and V of ``position + 1`` tokens in every layer."""
    h, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * inter + inter * h + 2 * h
    weights = cfg.num_hidden_layers * per_layer + cfg.vocab_size * h + h + h
    kv_bytes = cfg.num_hidden_layers * 2 * kv * (position + 1)
    return (weights + kv_bytes) * elem


def decode_rounds(args: argparse.Namespace, probe: Probe, threads_probe: int):
    from llmtower.core.outputs import EngineCoreRequest
    from llmtower.core.sampling_params import SamplingParams
    from llmtower.engine.args import EngineArgs
    from llmtower.engine.factory import create_engine_core

    core = create_engine_core(EngineArgs(
        model=args.model, dtype="bfloat16", num_threads=args.threads,
        kv_cache_memory="64MiB", enable_prefix_caching=False))
    cfg = core.executor.model.config  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, args.input_len).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def one(tag: str) -> tuple[float, float]:
        """(median step seconds, bytes of the median step) of one request's decode steps."""
        core.add_request(EngineCoreRequest(tag, prompt, sp))
        steps = []
        while core.has_unfinished_requests():
            t = time.perf_counter()
            core.step()
            steps.append(time.perf_counter() - t)
        dec = steps[1:]
        mid = args.input_len + len(dec) // 2
        return statistics.median(dec), step_bytes(cfg, mid, 2)

    one("warm")
    rows = []
    for r in range(args.rounds):
        bw = probe.gbps(threads_probe)
        sec, nbytes = one(f"r{r}")
        rows.append((bw, sec, nbytes))
    return rows


def main() -> None:
    args = parse_args()
    import torch

    load0 = os.getloadavg()[0]
    probe = Probe(args.buffer_mib)
    kind = "C streaming read" if probe.lib is not None else "numpy sum (no C compiler)"
    print(f"probe: {kind}, {args.buffer_mib} MiB buffer; load average {load0:.1f}")
    small = Probe(args.buffer_mib, huge=False, lib=probe.lib)
    hp = huge_page_bytes()
    print(f"huge pages: {hp / 2**20:.0f} MiB of this process's memory" if hp is not None
          else "huge pages: Linux does not say")
    for t in (1, 2):
        for name, p in (("4 KiB pages", small), ("huge pages", probe)):
            vals = [p.gbps(t) for _ in range(3)]
            print(f"  {t} thread(s), {name}: {max(vals):6.1f} GB/s best, "
                  f"{statistics.median(vals):6.1f} median")
    del small
    pt = args.threads or 2
    if probe.lib is not None:
        print(f"\nthe stream's effect on the host work after it ({pt} threads): "
              "plain loads against loads after a non-temporal prefetch")
        print("| prefetch | GB/s | host work after the stream, us | the same work hot, us |")
        print("|---|---|---|---|")
        for nta in (0, 512, 1024, 2048):
            bw, after, hot = cache_pollution(probe, pt, nta)
            name = f"prefetchnta {nta} B ahead" if nta else "none (plain loads)"
            print(f"| {name} | {bw:.1f} | {after:.1f} | {hot:.1f} |")
    if args.no_engine:
        return
    threads = args.threads or torch.get_num_threads()
    rows = decode_rounds(args, probe, threads)
    print(f"\none stream, bfloat16, {args.input_len} in / {args.output_len} out, probe with "
          f"{threads} thread(s) just before each round; load average {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    print("| round | probe GB/s | decode ms/step | MB read/step | floor ms | decode GB/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r, (bw, sec, nbytes) in enumerate(rows):
        eff = nbytes / sec / 1e9
        print(f"| {r} | {bw:.1f} | {sec * 1e3:.2f} | {nbytes / 1e6:.0f} | "
              f"{nbytes / bw / 1e6:.2f} | {eff:.1f} | {eff / bw:.2f} |")


if __name__ == "__main__":
    main()
