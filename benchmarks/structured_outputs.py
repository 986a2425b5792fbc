"""Structured outputs on the default model (SmolLM2-135M-Instruct): what grammars cost.

1. Step-time overhead of the grammar bitmask at batch 32: 32 requests decode together, once
   unconstrained and once under a JSON schema with a free-text string (the most expensive
   kind of mask: nearly every token is allowed inside a string), greedy, ignore_eos.
   Only steps where all 32 requests decode are timed; the two modes alternate ``--repeats``
   times in one process and the medians are compared. Also: the mask's own parts at batch 32
   (fill the bitmask on the scheduler side, apply it to the logits on the runner side).
2. Grammar compile time, cold (first compile of a schema; the first one of all also loads the
   tokenizer and builds xgrammar's tokenizer info) and cached (the second request with the
   same schema: a cache hit).
3. Jump-forward decoding on a schema-heavy workload (long fixed keys, enums, booleans):
   wall time and output tokens with and without it, validity, and how many greedy outputs
   differ from token-by-token decoding (forced text is tokenized by xgrammar, which can cut
   it differently from the model's tokenizer, and the model then continues from there).

    .venv/bin/python benchmarks/structured_outputs.py
    .venv/bin/python benchmarks/structured_outputs.py --batch 32 --decode-tokens 48 --repeats 3

The machine is shared: the load average is printed beside the figures; compare ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jsonschema
import numpy as np
import torch

from llmtower import LLM
from llmtower.core.sampling_params import SamplingParams
from llmtower.structured_output import StructuredOutputsParams

FREE_TEXT = {"type": "object", "properties": {"answer": {"type": "string"}},
             "required": ["answer"]}
HEAVY = {"type": "object", "properties": {
    "customer_identifier": {"type": "integer", "minimum": 0, "maximum": 999},
    "customer_full_name": {"type": "string", "maxLength": 12},
    "subscription_level": {"enum": ["basic_monthly_plan", "premium_annual_plan",
                                    "enterprise_custom_plan"]},
    "has_verified_email_address": {"type": "boolean"},
    "preferred_contact_channel": {"enum": ["electronic_mail", "telephone_call"]},
    "account_creation_year": {"type": "integer", "minimum": 2000, "maximum": 2030},
    "is_marketing_opt_in_enabled": {"type": "boolean"},
    "internal_risk_assessment_level": {"enum": ["negligible", "moderate", "elevated"]}},
    "required": ["customer_identifier", "customer_full_name", "subscription_level",
                 "has_verified_email_address", "preferred_contact_channel",
                 "account_creation_year", "is_marketing_opt_in_enabled",
                 "internal_risk_assessment_level"]}
COMPILE_SCHEMAS = [FREE_TEXT, HEAVY, {"type": "array", "items": HEAVY, "maxItems": 4},
                   {"type": "object", "properties": {f"field_{i}": {"type": "string"}
                                                     for i in range(40)}}]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip", default="", help="comma list of parts to skip: overhead,compile,jump")
    return p.parse_args()


def load() -> str:
    a, b, c = os.getloadavg()
    return f"load average {a:.1f} {b:.1f} {c:.1f}"


def prompts(llm: LLM, n: int, what: str) -> list[list[int]]:
    tok = llm.get_tokenizer()
    out = []
    for i in range(n):
        text = tok.apply_chat_template(
            [{"role": "user", "content": f"{what} (record {i})"}], tokenize=False,
            add_generation_prompt=True)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def timed_decode_steps(llm: LLM, ids: list[list[int]], sp: SamplingParams) -> list[float]:
    """Seconds of each engine step in which every request decoded (no prefill)."""
    core = llm.engine_core
    sched = core.scheduler
    times: list[float] = []
    step = core.step

    def timed_step():
        t0 = time.perf_counter()
        out = step()
        dt = time.perf_counter() - t0
        last = sched._last
        if last.num_prefill_tokens == 0 and len(last.scheduled) == len(ids):
            times.append(dt)
        return out

    core.step = timed_step
    try:
        llm.generate(ids, sp, use_tqdm=False)
    finally:
        core.step = step
    return times


def part_overhead(llm: LLM, args: argparse.Namespace) -> None:
    ids = prompts(llm, args.batch, "Describe a city in one long sentence as JSON")
    modes = {
        "unconstrained": SamplingParams(temperature=0.0, max_tokens=args.decode_tokens,
                                        ignore_eos=True),
        "json schema": SamplingParams(temperature=0.0, max_tokens=args.decode_tokens,
                                      ignore_eos=True,
                                      structured_outputs=StructuredOutputsParams(json=FREE_TEXT)),
    }
    timed_decode_steps(llm, ids[:2], modes["json schema"])  # warm up: tokenizer info, compile
    steps: dict[str, list[float]] = {m: [] for m in modes}
    grammar_s = _GrammarClock(llm)
    for _ in range(args.repeats):
        for m, sp in modes.items():
            with grammar_s:
                steps[m] += timed_decode_steps(llm, ids, sp)
    med = {m: statistics.median(v) for m, v in steps.items()}
    print(f"\n1. decode step at batch {args.batch} ({load()}):")
    for m in modes:
        print(f"   {m:14s} median {med[m] * 1e3:7.2f} ms over {len(steps[m])} steps")
    print(f"   A/B step-time overhead: {100 * (med['json schema'] / med['unconstrained'] - 1):+.1f}%"
          " (noisy on a loaded machine)")
    per_step = grammar_s.seconds / max(1, grammar_s.steps)
    print(f"   grammar work per constrained step (fill bitmask + apply + advance matchers): "
          f"{per_step * 1e3:.2f} ms = {100 * per_step / med['unconstrained']:.1f}% of an "
          "unconstrained step")
    # The mask's two parts, alone, at the same batch.
    manager = llm.engine_core.scheduler.structured_output
    backend = manager.backend
    compiled = backend.compile(StructuredOutputsParams(json=FREE_TEXT))
    matchers = [backend.new_matcher(compiled) for _ in range(args.batch)]
    for m in matchers:
        for t in llm.get_tokenizer().encode('{"answer": "The city', add_special_tokens=False):
            m.accept_token(t)

    class _R:
        def __init__(self, i, m):
            self.request_id = str(i)
            self.structured_output = type("S", (), {"matcher": m})()

    reqs = [_R(i, m) for i, m in enumerate(matchers)]
    fill = min(_timeit(lambda: manager.grammar_bitmask(reqs)) for _ in range(5))
    from llmtower.structured_output.bitmask import apply_grammar_bitmask
    from llmtower.core.outputs import SchedulerOutput
    rows, bitmask = manager.grammar_bitmask(reqs)
    so = SchedulerOutput.empty()
    so.structured_output_request_ids, so.grammar_bitmask = rows, bitmask
    vocab = llm.engine_core.model_info.vocab_size
    logits = torch.randn(args.batch, vocab)
    mask = np.ones(args.batch, dtype=bool)
    apply = min(_timeit(lambda: apply_grammar_bitmask(logits, so, list(rows), mask))
                for _ in range(5))
    print(f"   parts at batch {args.batch}: fill bitmask {fill * 1e3:.2f} ms, "
          f"apply to logits {apply * 1e3:.2f} ms")


class _GrammarClock:
    """Adds up the time spent in the grammar hooks of the engine (wrapping them)."""

    def __init__(self, llm: LLM) -> None:
        import llmtower.executor.model_runner as mr
        self.mr = mr
        self.manager = llm.engine_core.scheduler.structured_output
        self.seconds = 0.0
        self.steps = 0

    def _wrap(self, fn, count_step: bool = False):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.steps += count_step
        return timed

    def __enter__(self) -> None:
        m = self.manager
        self.saved = (m.grammar_bitmask, m.accept_token, self.mr.apply_grammar_bitmask)
        m.grammar_bitmask = self._wrap(m.grammar_bitmask, count_step=True)
        m.accept_token = self._wrap(m.accept_token)
        self.mr.apply_grammar_bitmask = self._wrap(self.mr.apply_grammar_bitmask)

    def __exit__(self, *exc) -> None:
        m = self.manager
        m.grammar_bitmask, m.accept_token, self.mr.apply_grammar_bitmask = self.saved


def _timeit(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def part_compile(llm: LLM) -> None:
    manager = llm.engine_core.scheduler.structured_output
    print(f"\n2. grammar compile ({load()}):")
    t0 = time.perf_counter()
    backend = manager.backend
    first = time.perf_counter() - t0
    print(f"   tokenizer info (first constrained request only): {first * 1e3:.1f} ms"
          + (" (already built)" if first < 1e-3 else ""))
    for i, schema in enumerate(COMPILE_SCHEMAS):
        params = StructuredOutputsParams(json=schema)
        cold = _timeit(lambda p=params: backend.compile(p))

        class _Req:
            request_id = f"c{i}"
            sampling_params = SamplingParams(structured_outputs=params)
            structured_output = None

        r1, r2 = _Req(), _Req()
        manager.add_request(r1)
        manager._cache[params.key].future.result()
        cached = _timeit(lambda r=r2: manager.add_request(r))
        print(f"   schema {i} ({len(params.spec)} chars): cold {cold * 1e3:7.2f} ms, "
              f"cached {cached * 1e6:6.1f} us")


def part_jump(llm: LLM, args: argparse.Namespace) -> None:
    ids = prompts(llm, args.batch, "Invent a customer record as JSON")
    sp = SamplingParams(temperature=0.0, max_tokens=300,
                        structured_outputs=StructuredOutputsParams(json=HEAVY))
    config = llm.engine_core.scheduler.structured_output.config
    llm.generate(ids[:1], SamplingParams(max_tokens=2, structured_outputs=sp.structured_outputs),
                 use_tqdm=False)  # warm up: the compile
    results = {}
    for _ in range(args.repeats):
        for jf in (False, True):
            config.jump_forward = jf
            manager = llm.engine_core.scheduler.structured_output
            forced0 = manager.num_forced_tokens
            t0 = time.perf_counter()
            outs = llm.generate(ids, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            texts = [o.outputs[0].text for o in outs]
            for t in texts:
                jsonschema.validate(json.loads(t), HEAVY)
            r = results.setdefault(jf, {"s": [], "texts": texts})
            r["s"].append(dt)
            r["tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
            r["forced"] = manager.num_forced_tokens - forced0
            print(f"   (jump_forward={jf}: {dt:.2f} s, {r['tokens']} tokens, {r['forced']} "
                  "forced)", flush=True)
    config.jump_forward = False
    off, on = results[False], results[True]
    t_off, t_on = statistics.median(off["s"]), statistics.median(on["s"])
    differ = sum(a != b for a, b in zip(off["texts"], on["texts"]))
    print(f"\n3. jump-forward, {args.batch} records of an 8-field schema, greedy ({load()}):")
    print(f"   off: {t_off:6.2f} s, {off['tokens']} output tokens")
    print(f"   on : {t_on:6.2f} s, {on['tokens']} output tokens, {on['forced']} of them "
          "forced (not sampled)")
    print(f"   speed-up {t_off / t_on:.2f}x; all {2 * args.batch} outputs valid; "
          f"{differ}/{args.batch} greedy outputs differ from token-by-token decoding")


def main() -> None:
    args = parse_args()
    skip = set(filter(None, args.skip.split(",")))
    llm = LLM(model=args.model, num_threads=args.threads, max_model_len=1024,
              kv_cache_memory="1GiB", seed=0)
    if "compile" not in skip:
        part_compile(llm)
    if "overhead" not in skip:
        part_overhead(llm, args)
    if "jump" not in skip:
        part_jump(llm, args)


if __name__ == "__main__":
    main()
