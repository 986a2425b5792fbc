"""Multi-LoRA throughput, offline: 64 prompts over 8 rank-16 adapters against the base model.

Three engines over the same weights (SmolLM2-135M-Instruct by default), each in a fresh process
of its own, alone on the machine while it runs, take turns on the same greedy, EOS-ignoring workload
(--num-prompts prompts of random lengths in --input-len-range, --output-len tokens each):
  - base:       no --enable-lora, every request on the base model;
  - base+lora:  --enable-lora --max-loras 8, still every request on the base model (what
                enabling LoRA costs a server whose requests name no adapter);
  - 8 adapters: --enable-lora --max-loras 8, request i with adapter i % 8.
The adapters are random rank-16 PEFT folders on every projection (q/k/v/o/gate/up/down),
written here. Each engine runs --repeats times, the order rotating every repeat; printed:
the median output tok/s of each and the ratios the issue asks for (8 adapters / base >= 0.7,
base+lora / base >= 0.95), with `uptime`'s load (a shared machine: compare ratios of one run).

    .venv/bin/python benchmarks/lora.py
    .venv/bin/python benchmarks/lora.py --num-prompts 16 --output-len 32 --repeats 1   # quick
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.core import EngineCore
from llmtower.engine.factory import create_engine_core
from llmtower.lora.adapter import LoRAModelShape
from llmtower.lora.request import LoRARequest
from llmtower.models.default_model import default_model_dir
from llmtower.models.loader import load_model_config

MODES = ("base", "base+lora", "8 adapters")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a model directory (default: SmolLM2-135M)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--input-len-range", default="32:128")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the default)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def write_adapter(out: Path, model_dir: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA folder of rank ``rank`` on every projection of the model."""
    from safetensors.torch import save_file

    shape = LoRAModelShape.from_config(load_model_config(model_dir))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for module, (d_in, d_out) in shape.dims.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": list(shape.dims), "base_model_name_or_path": str(model_dir)}))
    return out


def run(core: EngineCore, prompts: list[list[int]], loras: list[LoRARequest | None],
        output_len: int, tag: str) -> float:
    """Output tokens per second of the whole batch."""
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        core.add_request(EngineCoreRequest(f"{tag}-{i}", p, sp, lora_request=lora))
    num_out = 0
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            num_out += len(o.new_token_ids)
    return num_out / (time.perf_counter() - t0)


def engine_process(conn, args: argparse.Namespace, model: str, mode: str) -> None:
    lora = mode != "base"
    core = create_engine_core(EngineArgs(
        model=model, dtype=args.dtype, num_threads=args.threads, seed=0,
        enable_lora=lora, max_loras=args.num_adapters if lora else 1,
        max_lora_rank=args.rank))
    conn.send(core.model_info.num_threads if core.model_info else 0)
    while True:
        job = conn.recv()
        if job is None:
            break
        prompts, loras, tag = job
        rate = run(core, prompts, loras if mode == "8 adapters" else [None] * len(prompts),
                   args.output_len, tag)
        core.reset_prefix_cache()  # each repeat computes its prompts afresh
        conn.send(rate)
    core.shutdown()


def main() -> None:
    args = parse_args()
    model = args.model or str(default_model_dir())
    vocab = load_model_config(model).vocab_size
    tmp = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    loras = [LoRARequest(f"adapter{k}", k + 1,
                         str(write_adapter(tmp / f"a{k}", Path(model), args.rank, seed=k)))
             for k in range(args.num_adapters)]
    rng = np.random.default_rng(args.seed)
    lo, hi = (int(x) for x in args.input_len_range.split(":"))
    prompts = [rng.integers(0, vocab, int(n)).tolist()
               for n in rng.integers(lo, hi + 1, args.num_prompts)]
    per_prompt: list[LoRARequest | None] = [loras[i % len(loras)] for i in range(len(prompts))]
    ctx = mp.get_context("spawn")

    def measure(mode: str, tag: str) -> tuple[float, int]:
        """One engine process alone on the machine: started, warmed up, one timed batch,
        stopped. (Three engines alive side by side, idle ones included, cost the timed one
        10-20% on this 2-core machine, unevenly between modes.)"""
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=engine_process, args=(child, args, model, mode), daemon=True)
        proc.start()
        threads = parent.recv()
        # warm-up: first-call allocations, adapters read, stacks built
        parent.send(([p[:16] for p in prompts[:len(loras)]], per_prompt[:len(loras)], "warmup"))
        parent.recv()
        parent.send((prompts, per_prompt, tag))
        rate = parent.recv()
        parent.send(None)
        proc.join(timeout=60)
        return rate, threads

    print(f"model {model}, {args.dtype}; {args.num_prompts} prompts of "
          f"{lo}..{hi} tokens, {args.output_len} output tokens each; {len(loras)} adapters "
          f"of rank {args.rank}; {load()}", flush=True)
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        order = MODES[r % 3:] + MODES[:r % 3]
        threads = 0
        for mode in order:
            rate, threads = measure(mode, f"r{r}")
            rates[mode].append(rate)
        print(f"repeat {r} ({threads} threads): " + ", ".join(f"{m} {rates[m][-1]:.1f}" for m in MODES)
              + f" tok/s; {load()}", flush=True)
    med = {m: float(np.median(v)) for m, v in rates.items()}
    print(f"median output tok/s: base {med['base']:.1f}, base+lora {med['base+lora']:.1f}, "
          f"8 adapters {med['8 adapters']:.1f}")
    print(f"8 adapters / base = {med['8 adapters'] / med['base']:.3f} (target >= 0.7); "
          f"base+lora / base = {med['base+lora'] / med['base']:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
