"""One stream on the default model: prefill time and decode speed of a single request.

The issue's "one user chatting" case: one prompt of 144 random tokens, 128 output tokens,
greedy, EOS ignored, through the real EngineCore (scheduler + runner + model). Every variant
(dtype x quantization) is built once in this process, then the variants take turns, ``--rounds``
times, so that a noisy neighbour hits all of them alike; the medians are printed with their
ratio to the first variant, and the load average beside them (this machine is shared).

    .venv/bin/python benchmarks/one_stream.py
    .venv/bin/python benchmarks/one_stream.py --variants float32:none,bfloat16:gguf --rounds 5
    chrt -f 1 .venv/bin/python benchmarks/one_stream.py --variants bfloat16:none:4k,bfloat16:none

Fields after a variant's quantization are flags: ``4k`` builds that engine with huge pages
off (kernels/huge_pages.py: its packed weights and KV cache on ordinary 4 KiB pages);
``full`` runs it with the greedy screen off (model_runner.GREEDY_SCREEN: full logits and the
sampler every step, as before kernels/greedy_head.py).

    chrt -f 1 .venv/bin/python benchmarks/one_stream.py --variants bfloat16:none:full,bfloat16:none

Decode tok/s counts the steps after the first (prefill) one: 127 tokens over their wall time.

``--breakdown``: instead, the vs_vllm.sh harness's one-stream cell through ``LLM.generate``
(bfloat16, 4 GiB KV cache, max_model_len 512, greedy with min_tokens = max_tokens, EOS
ignored): end-to-end tok/s and TTFT, and where the time of a decode step goes (scheduler,
input preparation, the model's layers, lm_head, sampler, scheduler update, output processing),
in ms per decode step, medians over ``--rounds`` requests.

    chrt -f 1 .venv/bin/python benchmarks/one_stream.py --breakdown --rounds 5
    chrt -f 1 .venv/bin/python benchmarks/one_stream.py --breakdown --batch 64 --ab
    chrt -f 1 .venv/bin/python benchmarks/one_stream.py --breakdown --ab-screen
llama.cpp's figure to compare with (issue 9, same machine kind, Q4_1, 2 threads): 118 tok/s
decode only, 83 end to end.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.core import EngineCore
from llmtower.engine.factory import create_engine_core
from llmtower.executor import model_runner as runner_mod
from llmtower.kernels import huge_pages


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--variants", default="float32:none,bfloat16:none,bfloat16:gguf,"
                   "bfloat16:int4,bfloat16:int8",
                   help="comma-separated dtype:quantization pairs; the first is the baseline")
    p.add_argument("--input-len", type=int, default=144)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads; 0: the engine's default (all CPUs, fewer under contention)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--breakdown", action="store_true",
                   help="the harness's one-stream cell through LLM.generate, per-part times")
    p.add_argument("--dtype", default="bfloat16", help="--breakdown: the model's dtype")
    p.add_argument("--batch", type=int, default=1,
                   help="--breakdown: this many prompts at once (decode steps: all of them)")
    p.add_argument("--ab", action="store_true",
                   help="--breakdown: also the runner's general input path and torch's argmax, "
                        "in alternate rounds")
    p.add_argument("--ab-screen", action="store_true",
                   help="--breakdown: also full logits and the sampler (the greedy screen off), "
                        "in alternate rounds")
    return p.parse_args()


def one_request(core: EngineCore, prompt: list[int], output_len: int, tag: str
                ) -> tuple[float, float]:
    """(prefill seconds, decode tokens per second) of one greedy request run alone."""
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    core.add_request(EngineCoreRequest(tag, prompt, sp))
    steps: list[float] = []
    while core.has_unfinished_requests():
        t = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - t)
    decode = steps[1:]
    return steps[0], len(decode) / sum(decode)


class PartTimer:
    """Wraps methods of live objects (instance attributes) and sums their wall time per part;
    ``step()`` closes one engine step's record."""

    def __init__(self) -> None:
        self.cur: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.order: dict[str, None] = {}  # parts in the order they were wrapped

    def wrap(self, obj: object, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        self.order[name] = None

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.cur[name] = self.cur.get(name, 0.0) + time.perf_counter() - t

        setattr(obj, attr, timed)

    def step(self) -> None:
        self.steps.append(self.cur)
        self.cur = {}


class _Callable:
    """A stand-in for an object that is called (the model, the sampler) whose call is timed;
    everything else goes to the object."""

    def __init__(self, obj: object, timer: PartTimer, name: str) -> None:
        self._obj, self._timer, self._name = obj, timer, name
        timer.order[name] = None

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self._obj(*a, **kw)  # type: ignore[operator]
        finally:
            c = self._timer.cur
            c[self._name] = c.get(self._name, 0.0) + time.perf_counter() - t

    def __getattr__(self, name: str):
        return getattr(self._obj, name)


def breakdown(args: argparse.Namespace) -> None:
    """The vs_vllm.sh one-stream cell (bench_offline.py's llmtower settings), timed by part."""
    from llmtower import LLM

    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads or 2,
              max_model_len=512, kv_cache_memory="4GiB", seed=args.seed,
              enable_prefix_caching=False)
    core = llm.engine_core
    runner = core.executor.runner
    model = runner.model
    timer = PartTimer()
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(core.executor, "execute_model", "execute_model")
    timer.wrap(runner.batch, "update_request", "  batch.update_request")
    timer.wrap(runner, "_prepare_inputs", "  prepare_inputs")
    timer.wrap(runner, "_plan_decodes", "    _plan_decodes")
    timer.wrap(runner_mod, "plan_prompt_logprobs", "    plan_prompt_logprobs")
    runner.model = _Callable(model, timer, "  model")
    timer.wrap(model, "_logits", "    lm_head (+ .float())")
    if model.greedy_head is not None:
        timer.wrap(model, "greedy_tokens", "  greedy_tokens (screen + exact candidates)")
    dl = model.decode_layers
    if dl is not None:
        # A pure one-row decode step is one C call (every layer and the output layer); the
        # split path's parts below show only where a step does not take it.
        timer.wrap(dl, "step", "    decode_layers.step (whole step in C)")
        timer.wrap(dl, "attend_and_layers", "    layers 1..L-2 in C")
        timer.wrap(dl, "begin_step", "    decode_layers.begin_step")
        timer.wrap(dl, "layer", "    decode_layers.layer (layer 0 rest)")
    # The calls of layer 0 and the last layer (module functions and the kernels' objects).
    from llmtower.models import llama as llama_mod
    timer.wrap(llama_mod, "apply_linear", "    apply_linear (qkv 0, o L-1, head)")
    timer.wrap(llama_mod.F, "embedding", "    embedding")
    timer.wrap(runner.attn, "forward", "    attention (layers 0, L-1)")
    if model.fused is not None:
        for name in ("check_step", "rope_kv_write", "add_rms_norm", "silu_mul"):
            timer.wrap(model.fused, name, f"    fused.{name}")
    runner.sampler = _Callable(runner.sampler, timer, "  sampler")
    timer.wrap(runner, "_output", "  runner output")
    timer.wrap(runner.heap_trimmer, "after_step", "  heap_trimmer")
    timer.wrap(core.scheduler, "update_from_output", "update_from_output")
    timer.wrap(llm.output_processor, "process_outputs", "process_outputs")
    timer.wrap(core, "step", "engine step")
    timer.order["LLM step (all)"] = None
    step = llm._step

    def timed_step():
        t = time.perf_counter()
        out = step()
        timer.cur["LLM step (all)"] = time.perf_counter() - t
        timer.cur["_tokens"] = core.last_step_num_tokens
        timer.step()
        return out

    llm._step = timed_step  # type: ignore[method-assign]
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, model.config.vocab_size, args.input_len).tolist()
               for _ in range(args.batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                        min_tokens=args.output_len, ignore_eos=True, seed=args.seed)
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=8,
                                                   ignore_eos=True), use_tqdm=False)
    # --ab: the runner's decode fast path and numpy's argmax against what they replaced
    from llmtower.executor import sampler as sampler_mod
    fast_argmax = sampler_mod.argmax_rows
    variants = {"new": True, "old": False} if args.ab or args.ab_screen else {"new": True}
    load0 = os.getloadavg()[0]
    walls: dict[str, list[float]] = {v: [] for v in variants}
    ttfts: dict[str, list[float]] = {v: [] for v in variants}
    per_part: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    prefill: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v, on in variants.items():
            if args.ab_screen:
                runner_mod.GREEDY_SCREEN = on
            else:
                runner_mod.DECODE_FAST_PATH = on
                sampler_mod.argmax_rows = (fast_argmax if on else  # type: ignore[assignment]
                                           lambda lg: lg.argmax(dim=-1).numpy())
            timer.steps = []
            t = time.perf_counter()
            out = llm.generate(prompts, sp, use_tqdm=False)
            walls[v].append(time.perf_counter() - t)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in out)
            ttfts[v].append(timer.steps[0]["LLM step (all)"])
            prefill[v].append(timer.steps[0])
            # decode steps: every request has its one token (all prompts are in)
            dec = [st for st in timer.steps if st.pop("_tokens") == args.batch][1:]
            per_part[v].append({k: sum(st.get(k, 0.0) for st in dec) / len(dec)
                                for k in dec[0]})
    runner_mod.DECODE_FAST_PATH = runner_mod.GREEDY_SCREEN = True
    sampler_mod.argmax_rows = fast_argmax
    print(f"\n{args.batch} stream(s) (LLM.generate), {args.dtype}, {args.input_len} in / "
          f"{args.output_len} out, {args.rounds} rounds (median); load average {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    for v in variants:
        wall = statistics.median(walls[v])
        print(f"{v}: end to end {args.batch * args.output_len / wall:.1f} tok/s "
              f"({wall * 1e3:.0f} ms), first step {statistics.median(ttfts[v]) * 1e3:.1f} ms")
    total = statistics.median(p["LLM step (all)"] for p in per_part["new"])
    print("| part | ms per decode step | share |"
          + (" old path, ms |" if len(variants) > 1 else "") + " ms of the first step |")
    print("|---|---|---|" + ("---|" if len(variants) > 1 else "") + "---|")
    for k in sorted(per_part["new"][0], key=list(timer.order).index):
        val = statistics.median(p.get(k, 0.0) for p in per_part["new"])
        old = (f" {statistics.median(p.get(k, 0.0) for p in per_part['old']) * 1e3:.3f} |"
               if len(variants) > 1 else "")
        pre = statistics.median(p.get(k, 0.0) for p in prefill["new"])
        print(f"| {k} | {val * 1e3:.3f} | {val / total:.1%} |{old} {pre * 1e3:.2f} |")


def main() -> None:
    args = parse_args()
    if args.breakdown:
        breakdown(args)
        return
    variants = [tuple(v.split(":")) for v in args.variants.split(",")]
    cores: dict[tuple[str, ...], EngineCore] = {}
    for dtype, quant, *flags in variants:
        t = time.perf_counter()
        # "4k": this engine's weights and KV cache on ordinary 4 KiB pages.
        huge_pages.ENABLED = "4k" not in flags
        cores[(dtype, quant, *flags)] = create_engine_core(EngineArgs(
            model=args.model, dtype=dtype, quantization=quant, num_threads=args.threads,
            kv_cache_memory="64MiB", enable_prefix_caching=False))
        huge_pages.ENABLED = True
        print(f"built {':'.join((dtype, quant, *flags))} in {time.perf_counter() - t:.1f} s",
              flush=True)
    rng = np.random.default_rng(args.seed)
    vocab = next(iter(cores.values())).model_info.vocab_size  # type: ignore[union-attr]
    prompt = rng.integers(0, vocab, args.input_len).tolist()
    for key, core in cores.items():  # warm up: first-call allocations, kernel selection
        one_request(core, prompt[:16], 4, f"warm-{key}")
    results: dict[tuple[str, ...], list[tuple[float, float]]] = {k: [] for k in cores}
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        for key, core in cores.items():
            runner_mod.GREEDY_SCREEN = "full" not in key[2:]
            results[key].append(one_request(core, prompt, args.output_len, f"r{r}-{key}"))
    runner_mod.GREEDY_SCREEN = True
    load1 = os.getloadavg()[0]
    print(f"\none stream, {args.input_len} in / {args.output_len} out, threads "
          f"{args.threads or 'auto'}, "
          f"{args.rounds} rounds (median); load average {load0:.1f} -> {load1:.1f} "
          f"on {os.cpu_count()} CPUs")
    print("| dtype | quantization | pages | greedy | prefill ms | decode tok/s | vs first |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for (dtype, quant, *flags), rs in results.items():
        pre = statistics.median(x[0] for x in rs) * 1e3
        dec = statistics.median(x[1] for x in rs)
        base = base or dec
        pages = "4k" if "4k" in flags else "2M"
        model = cores[(dtype, quant, *flags)].executor.runner.model  # type: ignore[attr-defined]
        greedy = "full logits" if "full" in flags or model.greedy_head is None else "screen"
        print(f"| {dtype} | {quant} | {pages} | {greedy} | {pre:.0f} | {dec:.1f} "
              f"| {dec / base:.2f}x |")


if __name__ == "__main__":
    main()
