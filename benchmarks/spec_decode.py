"""Speculative decoding on SmolLM2-135M-Instruct: output tok/s with and without speculation.

Two workloads of 8 chat prompts each, greedy:
  copy  - rewrite / edit a given passage, code with repeated identifiers (much to copy);
  fresh - open questions and stories (nothing in the prompt to copy).
Each runs single-stream (one request at a time) and as a batch of 8 (all at once), without
speculation and with each method. One engine (the model loads once); each run gets a fresh
proposer (the suffix method's global tree starts empty) and an empty prefix cache, and the
runs of one repetition alternate between methods, so load on this shared machine hits all
alike. Greedy outputs must be identical with and without speculation (checked).

Prints, per workload x mode x method: output tok/s, the ratio to no speculation, acceptance
rate (accepted / draft tokens), mean accepted length (1 + accepted / drafts: tokens per
verification), and forward passes per output token. Speed is given twice: output tokens per
wall-clock second, and per CPU-second of this process (with one thread, what a quiet core
would give; on a machine shared with other jobs the wall-clock ratio is mostly noise).

    .venv/bin/python benchmarks/spec_decode.py                     # ngram and suffix
    .venv/bin/python benchmarks/spec_decode.py --methods ngram --reps 3 --max-tokens 128
    .venv/bin/python benchmarks/spec_decode.py --output-json /tmp/spec.json
    .venv/bin/python benchmarks/spec_decode.py --methods layerskip --layerskip-layers 8

``layerskip``: the draft_model method with a self-speculative draft built in memory from the
target itself (LayerSkip-style early exit): its first N layers, then its own final norm and
lm_head, sharing the tokenizer. SmolLM2 was not trained for early exit, so acceptance is
whatever its intermediate layers happen to predict.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.llm import LLM
from llmtower.spec_decode.config import SpeculativeConfig
from llmtower.executor.spec_decode_step import SpecDecodeStep
from llmtower.executor.spec_decode_setup import attach_spec_decode

PASSAGE = (
    "The village of Eldermoor sits at the edge of a deep forest. Every morning the baker "
    "opens his shop at six o'clock, and the smell of fresh bread fills the narrow streets. "
    "Children walk to the small school near the river, where their teacher, Mrs. Hale, "
    "tells them stories about the old mill and the people who built it long ago. In the "
    "evening the farmers come back from the fields and meet at the inn to talk about the "
    "weather, the harvest and the price of wheat.")
CODE = '''def compute_total(items, tax_rate):
    total = 0
    for item in items:
        price = item["price"]
        quantity = item["quantity"]
        total = total + price * quantity
    total = total + total * tax_rate
    return total


def compute_discount(items, discount_rate):
    discount = 0
    for item in items:
        price = item["price"]
        quantity = item["quantity"]
        discount = discount + price * quantity * discount_rate
    return discount
'''
COPY_PROMPTS = [
    f"Rewrite the following text, replacing 'Eldermoor' with 'Ashford'. Output only the "
    f"rewritten text.\n\n{PASSAGE}",
    f"Rename the variable `total` to `amount` in this code and output the whole code.\n\n{CODE}",
    f"Copy the following text exactly, then add one sentence at the end.\n\n{PASSAGE}",
    f"Add a docstring to each function in this code and output the whole code.\n\n{CODE}",
    "Repeat this list, adding a period after each item:\n- apples\n- bananas\n- cherries\n"
    "- dates\n- elderberries\n- figs\n- grapes\n- honeydew melons\n- kiwis\n- lemons",
    f"Fix the grammar of this text and output it in full.\n\n{PASSAGE.replace('walk', 'walks')}",
    f"Change the function names to snake_case with a `get_` prefix and output the code.\n\n{CODE}",
    "Convert this list of names to upper case, one per line: alice johnson, bob smith, "
    "carol williams, david brown, emma jones, frank miller, grace davis, henry wilson",
]
FRESH_PROMPTS = [
    "Write a short story about a dragon who learns to cook.",
    "Explain why the sky is blue.",
    "Give me five ideas for a birthday party.",
    "What are the benefits of regular exercise?",
    "Write a poem about the ocean at night.",
    "Describe a day in the life of a farmer.",
    "What is machine learning? Explain it to a child.",
    "Tell me about the history of ancient Rome.",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--methods", default="ngram,suffix",
                   help="comma-separated: ngram, suffix, draft_model (needs --draft-model)")
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    p.add_argument("--draft-model", default=None, help="the draft model for draft_model")
    p.add_argument("--layerskip-layers", type=int, default=8,
                   help="layers of the target kept in the layerskip draft")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--reps", type=int, default=1, help="repetitions (the median is kept)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", default="single,batch8")
    p.add_argument("--workloads", default="copy,fresh")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per workload (<= 8)")
    p.add_argument("--output-json", default=None)
    return p.parse_args()


def spec_config(method: str, args: argparse.Namespace) -> SpeculativeConfig | None:
    if method == "none":
        return None
    kw: dict = {"method": method, "num_speculative_tokens": args.k}
    if method == "ngram":
        kw.update(prompt_lookup_min=2, prompt_lookup_max=5)
    if method == "draft_model":
        kw["model"] = args.draft_model
    if method == "layerskip":  # a draft_model whose model is built in memory (attach_layerskip)
        kw.update(method="draft_model", model=f"{args.model} (first {args.layerskip_layers} layers)")
    return SpeculativeConfig(**kw)


def attach_layerskip(runner, cfg: SpeculativeConfig, num_layers: int, model_name: str) -> None:
    """The target's first ``num_layers`` layers + its final norm and lm_head as the draft."""
    import dataclasses

    from llmtower.models.llama import LlamaForCausalLM
    from llmtower.models.loader import load_model_config, load_state_dict, resolve_model_path
    from llmtower.executor.draft_model import DraftModelProposer

    target = runner.model
    path = resolve_model_path(model_name)
    mc = dataclasses.replace(load_model_config(path), num_hidden_layers=num_layers)
    keep = tuple(f"model.layers.{i}." for i in range(num_layers))
    state = {k: v for k, v in load_state_dict(path, target.dtype).items()
             if not k.startswith("model.layers.") or k.startswith(keep)}
    draft = LlamaForCausalLM(mc, state, target.dtype, runner.max_model_len)
    proposer = DraftModelProposer(draft, runner, cfg.num_speculative_tokens)
    runner.spec_decode = SpecDecodeStep(cfg, runner.sampler, runner.max_model_len, proposer)



def run_once(llm: LLM, prompts: list, mode: str, cfg: SpeculativeConfig | None,
             max_tokens: int, layerskip: int = 0, model_name: str = "") -> dict:
    """One run; ``layerskip``: the draft is the target's first that many layers."""
    core = llm.engine_core
    runner = core.executor.runner
    runner.spec_decode = None
    if cfg is not None and layerskip:
        attach_layerskip(runner, cfg, layerskip, model_name)
    elif cfg is not None:
        attach_spec_decode(core.executor, cfg, dtype=runner.model.dtype)
    core.reset_prefix_cache()
    sched = core.scheduler
    s0 = (sched.spec_stats.num_drafts, sched.spec_stats.num_draft_tokens,
          sched.spec_stats.num_accepted_tokens, sched.num_steps)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0, c0 = time.perf_counter(), time.process_time()
    load0 = os.getloadavg()[0]
    if mode == "single":
        outs = [llm.chat([[{"role": "user", "content": p}]], sp, use_tqdm=False)[0]
                for p in prompts]
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0
    tokens = [o.outputs[0].token_ids for o in outs]
    n_out = sum(len(t) for t in tokens)
    drafts = sched.spec_stats.num_drafts - s0[0]
    draft_tokens = sched.spec_stats.num_draft_tokens - s0[1]
    accepted = sched.spec_stats.num_accepted_tokens - s0[2]
    gate = getattr(runner.spec_decode, "gate", None)  # batch_gate.py: steps it kept closed
    return {"gate_closed_steps": gate.closed_steps_total if gate is not None else 0,
            "tok_s": n_out / elapsed, "tok_cpu_s": n_out / cpu, "cpu_s": cpu,
            "elapsed_s": elapsed, "output_tokens": n_out,
            "steps": sched.num_steps - s0[3], "drafts": drafts, "draft_tokens": draft_tokens,
            "accepted": accepted, "load": (load0 + os.getloadavg()[0]) / 2, "tokens": tokens}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    methods = ["none"] + [m for m in args.methods.split(",") if m]
    llm = LLM(model=args.model, num_threads=args.threads, max_model_len=2048,
              kv_cache_memory="1GiB", max_num_seqs=8)
    llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(temperature=0.0, max_tokens=4),
             use_tqdm=False)  # warm-up
    print(f"model loaded; load average {os.getloadavg()[0]:.1f}", flush=True)
    workloads = {"copy": COPY_PROMPTS[:args.num_prompts], "fresh": FRESH_PROMPTS[:args.num_prompts]}
    results: dict = {}
    for wl in args.workloads.split(","):
        for mode in args.modes.split(","):
            runs: dict[str, list[dict]] = {m: [] for m in methods}
            for _ in range(args.reps):
                for m in methods:
                    runs[m].append(run_once(llm, workloads[wl], mode, spec_config(m, args),
                                            args.max_tokens,
                                            args.layerskip_layers if m == "layerskip" else 0,
                                            args.model))
                    r = runs[m][-1]
                    print(f"  {wl}/{mode}/{m}: {r['tok_s']:.1f} tok/s, {r['tok_cpu_s']:.1f} tok per "
                          f"CPU-s, {r['output_tokens']} tokens in {r['elapsed_s']:.1f} s, "
                          f"{r['steps']} steps ({r['gate_closed_steps']} with drafting gated off), "
                          f"{r['draft_tokens']} draft tokens, {r['accepted']} accepted",
                          flush=True)
            base_tokens = runs["none"][0]["tokens"]
            base = statistics.median(r["tok_s"] for r in runs["none"])
            base_cpu = statistics.median(r["tok_cpu_s"] for r in runs["none"])
            print(f"\n== workload {wl}, {mode} (k={args.k}, max_tokens={args.max_tokens}, "
                  f"{args.threads} threads) ==")
            print(f"{'method':<12}{'tok/s':>8}{'ratio':>8}{'tok/cpu-s':>10}{'cpu ratio':>10}"
                  f"{'accept':>8}{'mean len':>9}{'steps/tok':>10}{'load':>7}  identical")
            for m in methods:
                rs = runs[m]
                tok_s = statistics.median(r["tok_s"] for r in rs)
                tok_cpu = statistics.median(r["tok_cpu_s"] for r in rs)
                r0 = rs[0]
                acc = r0["accepted"] / r0["draft_tokens"] if r0["draft_tokens"] else 0.0
                mean_len = 1 + r0["accepted"] / r0["drafts"] if r0["drafts"] else 1.0
                same = all(r["tokens"] == base_tokens for r in rs)
                print(f"{m:<12}{tok_s:>8.1f}{tok_s / base:>8.2f}{tok_cpu:>10.1f}"
                      f"{tok_cpu / base_cpu:>10.2f}{acc:>8.2f}{mean_len:>9.2f}"
                      f"{r0['steps'] / r0['output_tokens']:>10.2f}"
                      f"{statistics.mean(r['load'] for r in rs):>7.1f}  {same}")
                results[f"{wl}/{mode}/{m}"] = {
                    "tok_s": tok_s, "ratio": tok_s / base, "tok_per_cpu_s": tok_cpu,
                    "cpu_ratio": tok_cpu / base_cpu, "acceptance": acc,
                    "mean_accepted_length": mean_len, "identical_to_no_spec": same,
                    "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rs]}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
