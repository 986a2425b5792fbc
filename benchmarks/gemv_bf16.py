"""One stream on the default model in bfloat16 with decode GEMMs on oneDNN and on the few-row
kernel (``kernels/gemv_bf16.c``, switched by ``models.linear.GEMV_MAX_ROWS``), in one process
and one engine: the two settings take turns, so a noisy neighbour hits both alike.

Prints decode tok/s (127 steps after a 144-token prefill, greedy, EOS ignored) per setting,
whether the two produced the same tokens, and where a decode step's time goes (cProfile, wall
clock: run it at ``chrt -f 1`` on a shared machine; "the rest" is the unprofiled step time less
the named parts, so cProfile's own cost does not inflate it).

    chrt -f 1 .venv/bin/python benchmarks/gemv_bf16.py --threads 2

``--prefetch none,nta:1024,t2:2048``: instead, the few-row kernel with each software prefetch
setting (hint:bytes ahead, ``gemv_bf16.set_prefetch``) in turn, ``--rounds`` times: decode
tok/s per setting and round, with the load average of each round, and whether tokens agree.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import numpy as np

from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.core import EngineCore
from llmtower.engine.factory import create_engine_core
from llmtower.models import linear

# cProfile function names -> the part of a step they are.
# (ctypes calls are not profiled on their own: their time is their Python wrapper's, matched
# here by "file:function".)
CATEGORIES = {
    "GEMMs (oneDNN)": ("_linear_pointwise",),
    "GEMMs (few-row kernel)": ("gemv_bf16.py:__call__", "gemv_bf16.py:silu_mul"),
    "decode attention (C)": ("paged_decode",),
    "fused C ops": ("fused_ops.py:add_rms_norm", "fused_ops.py:rope_kv_write",
                    "fused_ops.py:silu_mul"),
    "logits .float() + argmax": ("'float'", "'argmax'"),
}
SETTINGS = {"oneDNN": 0, "few-row kernel": linear.GEMV_MAX_ROWS}
_BF16_ROWS = linear.BF16_KERNEL_MAX_ROWS


def use_rows(rows: int) -> None:
    """The few-row kernel up to ``rows``; 0: oneDNN for every product (gemm_bf16 off too, as
    it would otherwise take the rows the few-row kernel gives up)."""
    linear.GEMV_MAX_ROWS = rows
    linear.BF16_KERNEL_MAX_ROWS = _BF16_ROWS if rows else 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=144)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefetch", default="",
                   help="comma-separated hint:distance settings of the tile prefetch to compare")
    return p.parse_args()


def prefetch_ab(core: EngineCore, prompt: list[int], args: argparse.Namespace) -> None:
    """Decode tok/s of each prefetch setting, the settings taking turns each round."""
    from llmtower.kernels import gemv_bf16

    settings = [(h, int(d or 1024)) for h, _, d in (x.partition(":")
                                                    for x in args.prefetch.split(","))]
    rates: dict[str, list[float]] = {f"{h}:{d}": [] for h, d in settings}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        line = []
        for h, d in settings:
            gemv_bf16.set_prefetch(h, d)
            steps, toks = run(core, prompt, args.output_len, f"{r}-{h}-{d}")
            rates[f"{h}:{d}"].append(len(steps) / sum(steps))
            tokens[f"{h}:{d}"] = toks
            line.append(f"{h}:{d} {rates[f'{h}:{d}'][-1]:.1f}")
        print(f"round {r}: " + ", ".join(line) + f" tok/s; load {os.getloadavg()[0]:.2f}",
              flush=True)
    gemv_bf16.set_prefetch("none")
    base = statistics.median(next(iter(rates.values())))
    for name, rs in rates.items():
        m = statistics.median(rs)
        print(f"{name:>10}: decode {m:6.1f} tok/s ({m / base:.3f}x) median of {len(rs)}")
    ref = next(iter(tokens.values()))
    print("tokens identical across settings:", all(t == ref for t in tokens.values()))


def run(core: EngineCore, prompt: list[int], n: int, tag: str,
        prof: cProfile.Profile | None = None) -> tuple[list[float], list[int]]:
    """Decode step times (after the prefill step) and the tokens of one greedy request."""
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    core.add_request(EngineCoreRequest(tag, prompt, sp))
    steps: list[float] = []
    tokens: list[int] = []
    first = True
    while core.has_unfinished_requests():
        if prof is not None and not first:
            prof.enable()
        t = time.perf_counter()
        out = core.step()
        dt = time.perf_counter() - t
        if prof is not None:
            prof.disable()
        if not first:
            steps.append(dt)
        first = False
        for o in getattr(out, "outputs", []) or []:
            tokens.extend(getattr(o, "new_token_ids", []) or [])
    return steps, tokens


def breakdown(prof: cProfile.Profile, steps: int) -> dict[str, float]:
    """ms per step of each category."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    out = dict.fromkeys(CATEGORIES, 0.0)
    for (file, _, name), (_, _, tt, _, _) in stats.items():
        where = f"{os.path.basename(file)}:{name}"
        for cat, names in CATEGORIES.items():
            if any(n in where for n in names):
                out[cat] += tt * 1e3 / steps
                break
    return out


def main() -> None:
    args = parse_args()
    core = create_engine_core(EngineArgs(
        model=args.model, dtype=args.dtype, num_threads=args.threads, kv_cache_memory="64MiB",
        enable_prefix_caching=False))
    vocab = core.model_info.vocab_size  # type: ignore[union-attr]
    prompt = np.random.default_rng(0).integers(0, vocab, args.input_len).tolist()
    run(core, prompt[:16], 4, "warm")
    if args.prefetch:
        prefetch_ab(core, prompt, args)
        return
    rates: dict[str, list[float]] = {k: [] for k in SETTINGS}
    medians: dict[str, list[float]] = {k: [] for k in SETTINGS}
    tokens: dict[str, list[int]] = {}
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        for name, rows in SETTINGS.items():
            use_rows(rows)
            steps, toks = run(core, prompt, args.output_len, f"{r}-{name}")
            rates[name].append(len(steps) / sum(steps))
            medians[name].append(statistics.median(steps) * 1e3)
            tokens[name] = toks
    profiles: dict[str, dict[str, float]] = {}
    for name, rows in SETTINGS.items():
        use_rows(rows)
        prof = cProfile.Profile()
        steps, _ = run(core, prompt, args.output_len, f"prof-{name}", prof)
        parts = breakdown(prof, len(steps))
        step = statistics.median(medians[name])
        parts["the rest (Python, small ops)"] = step - sum(parts.values())
        profiles[name] = {"step (median, unprofiled)": step, **parts}
    load1 = os.getloadavg()[0]
    print(f"\n{args.dtype}, one stream, {args.input_len} in / {args.output_len} out, "
          f"{args.threads} threads, {args.rounds} rounds; load average {load0:.1f} -> {load1:.1f}")
    base = statistics.median(rates["oneDNN"])
    for name in SETTINGS:
        rate = statistics.median(rates[name])
        print(f"{name:>15}: decode {rate:6.1f} tok/s ({rate / base:.2f}x)  rounds: "
              + ", ".join(f"{x:.1f}" for x in rates[name]))
    a, b = tokens.values()
    same = sum(x == y for x, y in zip(a, b))
    print(f"greedy tokens the same: {same}/{len(a)} (first difference at "
          f"{next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)})")
    print("\n| ms per decode step | " + " | ".join(SETTINGS) + " |")
    print("|---|" + "---|" * len(SETTINGS))
    for row in next(iter(profiles.values())):
        print(f"| {row} | " + " | ".join(f"{profiles[n][row]:.2f}" for n in SETTINGS) + " |")


if __name__ == "__main__":
    main()
