"""`llmtower bench throughput`: offline throughput of the in-process engine, in the manner of
`vllm bench throughput`: all prompts are submitted at once and the engine runs until every
request is done; requests/s, total tokens/s and output tokens/s are printed.

Prompts are random token ids: ``--input-len`` tokens each, or lengths uniform in
``[input_len * (1 - r), input_len * (1 + r)]`` with ``--random-range-ratio r``, or uniform in
``--input-len-range LO:HI``. ``--model w1`` is the synthetic W1 model (see bench/synthetic.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmtower.bench.synthetic import is_synthetic_model, synthetic_model_dir
from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs

if TYPE_CHECKING:  # the engine (and torch) load when a run starts, not when the CLI parses
    from llmtower.engine.core import EngineCore


@dataclass
class ThroughputResult:
    """The figures of one throughput run."""

    model: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_time: float
    requests_per_second: float
    tokens_per_second: float
    output_tokens_per_second: float
    num_preemptions: int
    num_steps: int


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64, help="number of prompts (default: 64)")
    parser.add_argument("--input-len", type=int, default=144,
                        help="prompt length in tokens (default: 144)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="tokens to generate per prompt (default: 128)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="prompt lengths uniform in input_len * [1 - r, 1 + r] (default: 0)")
    parser.add_argument("--input-len-range", default=None, metavar="LO:HI",
                        help="prompt lengths uniform in [LO, HI] (overrides --input-len)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate exactly --output-len tokens, whatever the model says")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature, 0 for greedy (default: 1.0, as vLLM's)")
    parser.add_argument("--output-json", default=None, help="write the result as JSON to this file")
    parser.add_argument("--disable-tqdm", action="store_true",
                        help="no progress bar (it is written to stderr)")
    EngineArgs.add_cli_args(parser)


def input_lengths(num_prompts: int, input_len: int, range_ratio: float, len_range: str | None,
                  rng: np.random.Generator) -> np.ndarray:
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} is invalid: use 1 or more")
    if len_range:
        try:
            lo, hi = (int(x) for x in len_range.split(":"))
        except ValueError:
            raise ValueError(f"--input-len-range {len_range!r} is invalid: use LO:HI, e.g. 32:256") from None
        if not 1 <= lo <= hi:
            raise ValueError(f"--input-len-range {len_range!r} is invalid: need 1 <= LO <= HI")
        return rng.integers(lo, hi + 1, size=num_prompts)
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random_range_ratio={range_ratio} is invalid: use 0 <= r < 1")
    if input_len < 1:
        raise ValueError(f"input_len={input_len} is invalid: use 1 or more")
    lo = max(1, int(input_len * (1 - range_ratio)))
    return rng.integers(lo, int(input_len * (1 + range_ratio)) + 1, size=num_prompts)


def random_prompts(lengths: np.ndarray, vocab_size: int, rng: np.random.Generator) -> list[list[int]]:
    return [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lengths]


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    """The benchmark's prompts: the same for the same arguments and seed."""
    rng = np.random.default_rng(args.seed)
    lengths = input_lengths(args.num_prompts, args.input_len, args.random_range_ratio,
                            args.input_len_range, rng)
    return random_prompts(lengths, vocab_size, rng)


def run_engine(core: EngineCore, prompts: list[list[int]], sp: SamplingParams,
               prefix: str = "bench", progress: bool = False,
               tokens: dict[str, list[int]] | None = None) -> tuple[float, int]:
    """Submit every prompt, step until all are done; (seconds, output tokens). With
    ``progress``, a bar of finished requests on stderr (its updates are outside the engine's
    step, and cost microseconds per step). ``tokens``, if given, collects each request's output
    token ids under its prompt's index (benchmarks compare settings' outputs with it)."""
    eos = None if sp.ignore_eos else _first_eos(core)
    from tqdm.auto import tqdm
    bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{prefix}-{i}", p, sp, eos_token_id=eos))
    num_out = 0
    try:
        while core.has_unfinished_requests():
            done = 0
            for o in core.step().outputs:
                num_out += len(o.new_token_ids)
                done += o.finished
                if tokens is not None:
                    tokens.setdefault(o.request_id.rsplit("-", 1)[1], []).extend(o.new_token_ids)
            if done:
                bar.update(done)
                bar.set_postfix_str(f"{num_out / (time.perf_counter() - t0):.0f} output tok/s",
                                    refresh=False)
    finally:
        bar.close()
    return time.perf_counter() - t0, num_out


def _first_eos(core: EngineCore) -> int | None:
    ids = core.model_info.eos_token_ids if core.model_info else []
    return ids[0] if ids else None


def run(args: argparse.Namespace) -> int:
    from llmtower.engine.factory import create_engine_core

    model_name = args.model
    if is_synthetic_model(args.model):
        args.model = str(synthetic_model_dir(args.model, seed=0))
    engine_args = EngineArgs.from_cli_args(args)
    core = create_engine_core(engine_args)
    assert core.model_info is not None  # create_engine_core loads a real model
    prompts = make_prompts(args, core.model_info.vocab_size)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                        ignore_eos=args.ignore_eos, seed=None)
    # Warm up once (first-call allocations and kernel selection), then forget its cache.
    run_engine(core, [prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4), "warmup")
    core.reset_prefix_cache()
    sched = core.scheduler
    preempt0, steps0 = sched.num_preemptions, sched.num_steps
    elapsed, num_out = run_engine(core, prompts, sp, progress=not args.disable_tqdm)
    num_in = sum(len(p) for p in prompts)
    result = ThroughputResult(
        model=model_name, num_requests=len(prompts), num_prompt_tokens=num_in,
        num_output_tokens=num_out, elapsed_time=elapsed,
        requests_per_second=len(prompts) / elapsed, tokens_per_second=(num_in + num_out) / elapsed,
        output_tokens_per_second=num_out / elapsed,
        num_preemptions=sched.num_preemptions - preempt0, num_steps=sched.num_steps - steps0)
    print(f"Throughput: {result.requests_per_second:.2f} requests/s, "
          f"{result.tokens_per_second:.2f} total tokens/s, "
          f"{result.output_tokens_per_second:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {num_in}")
    print(f"Total num output tokens:  {num_out}")
    print(f"Elapsed: {elapsed:.2f} s, {result.num_steps} steps, {result.num_preemptions} preemptions")
    if args.output_json:
        out = asdict(result)
        out["engine_args"] = {k: v for k, v in vars(engine_args).items()}
        Path(args.output_json).write_text(json.dumps(out, indent=2, default=str))
    core.shutdown()
    return 0
