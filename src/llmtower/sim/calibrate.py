"""`llmtower simulate calibrate`: measure the real CPU engine's step time over a grid of batch
shapes and fit the "cpu" device profile the simulator uses on this machine.

The grid: for each context length C and decode batch D, D requests with C-token prompts are
prefilled (each prefill step is a sample), then one sample of pure decode steps and one per
prefill size P of mixed steps (the decode batch plus one P-token prompt), each the median of
a few repeated steps. A sample is the wall time of one ``EngineCore.step()`` (schedule +
forward pass + update), because that is what a simulated step stands for; its shape (tokens,
sampled, attention pairs, KV tokens, requests) comes from the ``SchedulerOutput`` through the
same BatchTracker the SimExecutor uses.

The fit (``fit_device``): step = o + s * seqs + max(F / flops, B / bandwidth), with F and B the
FLOPs and bytes the cost model counts for the model. For a fixed ratio k = flops / bandwidth
the model is linear in (o, s, 1/flops); k is searched on a log grid, each candidate solved by
least squares on relative errors. The additive form o + s * seqs + F / flops + B / bandwidth
(compute and memory traffic taking turns, as they mostly do in a CPU engine) is one linear
solve; the form that fits better is kept. Points more than 4 median deviations off are
dropped once before the final fit.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from llmtower.core.outputs import ModelRunnerOutput, SchedulerOutput
from llmtower.sim.batch_tracker import BatchTracker, StepShape
from llmtower.sim.profiles import (DeviceProfile, ModelProfile, available, load_model,
                                   save_profile, user_profile_dir)
from llmtower.utils import cpu_info

DEFAULT_CONTEXTS = (32, 256, 1024)
DEFAULT_DECODE_BATCHES = (1, 4, 16, 64)
DEFAULT_PREFILLS = (16, 128, 512)


@dataclass
class StepSample:
    """One measured step: its shape and its wall time."""

    num_tokens: int
    num_sampled: int
    attn_pairs: int
    kv_tokens: int
    num_seqs: int
    seconds: float


class TimedExecutor:
    """Owns a BatchTracker beside a real executor, recording the shape of each step it runs;
    everything else is delegated to the real executor."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.tracker = BatchTracker()
        self.last_shape: StepShape | None = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.last_shape = self.tracker.step(scheduler_output)
        return self.inner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def __getattr__(self, name):
        return getattr(self.inner, name)


# ---------------------------------------------------------------------- fitting
def _flops_bytes(model: ModelProfile, s: list[StepSample]) -> tuple[np.ndarray, np.ndarray]:
    tok = np.array([x.num_tokens for x in s], dtype=np.float64)
    samp = np.array([x.num_sampled for x in s], dtype=np.float64)
    attn = np.array([x.attn_pairs for x in s], dtype=np.float64)
    kv = np.array([x.kv_tokens for x in s], dtype=np.float64)
    flops = (tok * model.linear_flops_per_token + samp * model.lm_head_flops_per_sample
             + attn * model.attn_flops_per_context_token)
    nbytes = model.weight_bytes_read_per_step + (kv + tok) * model.kv_bytes_per_token
    return flops, nbytes


@dataclass
class _Fit:
    """One fitted form: t = o + s*seqs + combine(a*F, b*B), combine = max or sum."""

    overlap: str
    o: float
    s: float
    a: float  # seconds per FLOP
    b: float  # seconds per byte

    def predict(self, flops, nbytes, seqs) -> np.ndarray:
        c, m = self.a * flops, self.b * nbytes
        return self.o + self.s * seqs + (np.maximum(c, m) if self.overlap == "max" else c + m)

    def error(self, flops, nbytes, seqs, t) -> float:
        return float(np.mean(((self.predict(flops, nbytes, seqs) - t) / t) ** 2))


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray, free: tuple[int, ...] = ()) -> np.ndarray:
    """Least squares with every coefficient >= 0 except those in ``free``: drop the most
    negative one and solve again (few columns, so this small active-set loop suffices)."""
    active = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        coef[active], *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        bad = [i for i in active if coef[i] < 0 and i not in free]
        if not bad:
            return coef
        active.remove(min(bad, key=lambda i: coef[i]))


def _fit_max(flops, nbytes, seqs, t, use_seq) -> _Fit:
    """t = o + s*seqs + a*max(F, k*B): linear for a fixed k = (s/byte) / (s/FLOP); k is
    searched on a log grid, then twice on finer grids around the best point."""
    ratio = flops / nbytes
    lo, hi = max(ratio.min() / 10, 1e-6), ratio.max() * 10
    best: tuple[float, _Fit] | None = None
    for _ in range(3):
        for k in np.geomspace(lo, hi, 200):
            work = np.maximum(flops, k * nbytes)
            cols = [np.ones_like(t), work] + ([seqs] if use_seq else [])
            coef = _nonneg_lstsq(np.stack(cols, axis=1) / t[:, None], np.ones_like(t))
            a = max(coef[1], 1e-30)
            fit = _Fit("max", coef[0], coef[2] if use_seq else 0.0, a, a * k)
            err = fit.error(flops, nbytes, seqs, t)
            if best is None or err < best[0]:
                best = (err, fit)
        assert best is not None  # the scan above tried 200 points
        step = (hi / lo) ** (1 / 199)
        k_best = best[1].b / best[1].a
        lo, hi = k_best / step, k_best * step
    assert best is not None
    return best[1]


def _fit_sum(flops, nbytes, seqs, t, use_seq) -> _Fit:
    """t = o + s*seqs + a*F + b*B: one non-negative least-squares solve."""
    cols = [np.ones_like(t), flops, nbytes] + ([seqs] if use_seq else [])
    coef = _nonneg_lstsq(np.stack(cols, axis=1) / t[:, None], np.ones_like(t))
    return _Fit("sum", coef[0], coef[3] if use_seq else 0.0, max(coef[1], 1e-30),
                max(coef[2], 1e-30))


def fit_device(samples: list[StepSample], model: ModelProfile, name: str = "cpu",
               fit_seq_overhead: bool = True, memory_bytes: float | None = None,
               description: str = "", source: str = "",
               overlap: str | None = None) -> tuple[DeviceProfile, dict]:
    """Fit effective FLOP/s, bandwidth, per-step and per-request overhead to measured steps,
    for compute and memory traffic that overlap (``max``), take turns (``sum``) or, with
    ``overlap=None``, whichever of the two fits better."""
    if len(samples) < 4:
        raise ValueError(f"need at least 4 measured steps to fit a profile, got {len(samples)}")
    forms = {"max": _fit_max, "sum": _fit_sum}
    if overlap is not None and overlap not in forms:
        raise ValueError(f"overlap={overlap!r} must be 'max', 'sum' or None (fit both, keep "
                         "the better)")
    flops, nbytes = _flops_bytes(model, samples)
    t = np.array([x.seconds for x in samples], dtype=np.float64)
    seqs = np.array([x.num_seqs for x in samples], dtype=np.float64)
    mask = np.ones(len(t), dtype=bool)
    errors: dict[str, float] = {}
    best: _Fit | None = None
    for attempt in range(2):
        fits = [forms[f](flops[mask], nbytes[mask], seqs[mask], t[mask], fit_seq_overhead)
                for f in ([overlap] if overlap else forms)]
        errors = {f.overlap: f.error(flops[mask], nbytes[mask], seqs[mask], t[mask]) for f in fits}
        best = min(fits, key=lambda f: errors[f.overlap])
        if attempt == 0:  # drop gross outliers (another process stole the CPU), refit once
            rel_all = (best.predict(flops, nbytes, seqs) - t) / t
            dev = np.abs(rel_all - np.median(rel_all))
            mad = max(float(np.median(dev)), 0.005)  # never below 0.5%: timer noise
            mask = dev <= 4 * 1.4826 * mad
            if mask.sum() < 4:
                mask[:] = True
    assert best is not None  # the loop above ran twice
    flops_s, bw = 1.0 / best.a, 1.0 / best.b
    pred = best.predict(flops, nbytes, seqs)
    rel = (pred - t) / t
    memory_bound = int((nbytes / bw > flops / flops_s)[mask].sum())
    report = {
        "model": model.name, "overlap": best.overlap, "points": int(len(t)),
        "points_used": int(mask.sum()),
        "mean_abs_rel_err": float(np.mean(np.abs(rel[mask]))),
        "max_abs_rel_err": float(np.max(np.abs(rel[mask]))),
        "rmse_ms": float(np.sqrt(np.mean((pred[mask] - t[mask]) ** 2)) * 1000),
        "rms_rel_err_by_form": {f: float(np.sqrt(e)) for f, e in errors.items()},
        "step_ms_range": [float(t.min() * 1000), float(t.max() * 1000)],
        "memory_bound_points": memory_bound,
    }
    notes = ("effective numbers (efficiency 1.0) fitted to whole engine steps of the model in "
             "'calibration', at its dtype; swapping is a memcpy at the fitted bandwidth")
    if best.overlap == "max" and memory_bound == 0:
        notes += ("; memory traffic never dominated a measured step, so mem_bandwidth is not "
                  "identified (weight streaming is inside step_overhead_s)")
    profile = DeviceProfile(
        name=name, peak_flops=float(flops_s), mem_bandwidth=float(bw),
        memory_bytes=float(memory_bytes or _total_memory()), compute_efficiency=1.0,
        bandwidth_efficiency=1.0, step_overhead_s=float(best.o), seq_overhead_s=float(best.s),
        overlap=best.overlap, host_bandwidth=float(bw), description=description, source=source,
        notes=notes, calibration=report)
    return profile, report


def _total_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9


def _cpu_name() -> str:
    return cpu_info().model_name or platform.processor() or "unknown CPU"


# ---------------------------------------------------------------------- measuring
def _timed_step(engine) -> tuple[list, StepSample | None]:
    t0 = time.perf_counter()
    out = engine.step()
    dt = time.perf_counter() - t0
    ex: TimedExecutor = engine.executor
    shape, ex.last_shape = ex.last_shape, None
    if shape is None or not shape.num_tokens:
        return out.outputs, None
    return out.outputs, StepSample(shape.num_tokens, shape.num_sampled, shape.attn_pairs,
                                   shape.kv_tokens, shape.num_seqs, dt)


def _median_step(engine, repeats: int, before=None) -> StepSample | None:
    """Run ``repeats`` like steps (``before()`` prepares each) and keep the median time, with
    the shape of the middle one: on a shared machine a step that lost the CPU to another
    process is an outlier, not the cost of the batch."""
    got = []
    for _ in range(repeats):
        if before is not None:
            before()
        _, sample = _timed_step(engine)
        if sample is not None:
            got.append(sample)
    if not got:
        return None
    mid = got[len(got) // 2]
    mid.seconds = float(np.median([g.seconds for g in got]))
    return mid


def measure_grid(engine, contexts=DEFAULT_CONTEXTS, decode_batches=DEFAULT_DECODE_BATCHES,
                 prefills=DEFAULT_PREFILLS, steps_per_sample: int = 5, vocab_size: int = 256,
                 seed: int = 0, max_prefill_tokens: int = 8192, log=None) -> list[StepSample]:
    """Drive ``engine`` (an EngineCore whose executor is wrapped in a TimedExecutor) through
    the grid; returns one sample per prefill step and one per (cell, decode) and (cell,
    prefill size), each the median of ``steps_per_sample`` steps. Cells whose prefill exceeds
    ``max_prefill_tokens`` (D x C) are skipped."""
    from llmtower.core.outputs import EngineCoreRequest
    from llmtower.core.sampling_params import SamplingParams

    rng = random.Random(seed)
    samples: list[StepSample] = []
    sched = engine.scheduler
    max_len = sched.config.max_model_len
    capacity = sched.cache_config.num_blocks * sched.cache_config.block_size
    uid = 0

    def add(prompt_len: int, max_tokens: int) -> str:
        nonlocal uid
        uid += 1
        rid = f"cal-{uid}"
        engine.add_request(EngineCoreRequest(
            rid, [rng.randrange(vocab_size) for _ in range(prompt_len)],
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)))
        return rid

    # Warm-up: the first steps pay for lazy initialisation and first-touch page faults.
    for _ in range(4):
        add(256, 8)
    while engine.has_unfinished_requests():
        _timed_step(engine)
    for c in contexts:
        for d in decode_batches:
            extra = steps_per_sample * (1 + len(prefills)) + 2
            if (c + extra > max_len or d > sched.config.max_num_seqs or d * c > max_prefill_tokens
                    or d * (c + extra) + max(prefills, default=0) > capacity):
                continue  # does not fit, or its prefill alone would take minutes on a CPU
            ids = [add(c, extra + 8) for _ in range(d)]
            started: set[str] = set()
            while len(started) < d:  # prefill steps (chunked when over the token budget)
                outs, sample = _timed_step(engine)
                started.update(o.request_id for o in outs)
                if sample is not None:
                    samples.append(sample)
            cell = [_median_step(engine, steps_per_sample)]
            for p in prefills:
                if p + 1 <= max_len:
                    cell.append(_median_step(engine, steps_per_sample, lambda p=p: add(p, 1)))
            samples += [x for x in cell if x is not None]
            engine.abort_requests(ids)
            if log:
                log(f"context {c:>5}, decode batch {d:>3}: {len(samples)} samples")
    return samples


# ---------------------------------------------------------------------- CLI
def add_cli_args(p: argparse.ArgumentParser) -> None:
    from llmtower.engine.args import EngineArgs
    p.add_argument("--model-profile", default=None,
                   help="model profile for the FLOP/byte counts (default: read from the model "
                        "directory's config.json, or the profile named like --model)")
    p.add_argument("--output", default=None,
                   help=f"profile file to write (default: {user_profile_dir() / 'cpu.json'})")
    p.add_argument("--name", default="cpu", help="device profile name")
    p.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)))
    p.add_argument("--decode-batches", default=",".join(map(str, DEFAULT_DECODE_BATCHES)))
    p.add_argument("--prefills", default=",".join(map(str, DEFAULT_PREFILLS)))
    p.add_argument("--repeats", type=int, default=1, help="times the whole grid is measured")
    p.add_argument("--steps-per-sample", type=int, default=5,
                   help="like steps timed for each decode / mixed sample (the median is kept)")
    p.add_argument("--save-samples", default=None,
                   help="also write every measured step (shape and seconds) as JSON")
    p.add_argument("--no-seq-overhead", action="store_true",
                   help="fit only per-step overhead, FLOP/s and bandwidth")
    EngineArgs.add_cli_args(p)
    p.set_defaults(enable_prefix_caching=False)


def save_samples(samples: list[StepSample], path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(s) for s in samples], indent=0) + "\n")
    return out


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        vals = ()
    if not vals or min(vals) < 1:
        raise ValueError(f"--{what} {text!r}: give comma-separated integers >= 1")
    return vals


def model_profile_for(args, engine_args) -> ModelProfile:
    name = args.model_profile
    if name is None:
        m = Path(engine_args.model)
        if m.is_dir() and (m / "config.json").is_file():
            name = str(m)
        elif engine_args.model in available("model"):
            name = engine_args.model
        else:
            raise ValueError(f"cannot tell the shapes of model {engine_args.model!r}: pass "
                             "--model-profile NAME (e.g. smollm2-135m) or a model directory")
    prof = load_model(name)
    # The dtype the engine being calibrated runs in ('auto' resolved by this CPU).
    prof = replace(prof, dtype=engine_args.resolved_dtype())
    return prof


def calibrate_engine(engine, model: ModelProfile, *, contexts=DEFAULT_CONTEXTS,
                     decode_batches=DEFAULT_DECODE_BATCHES, prefills=DEFAULT_PREFILLS,
                     repeats: int = 1, steps_per_sample: int = 5, name: str = "cpu",
                     fit_seq_overhead: bool = True,
                     threads: int = 0, log=None):
    """Measure the grid ``repeats`` times on a ready EngineCore (left as it was found) and
    fit; returns (profile, report, samples)."""
    inner = engine.executor
    engine.executor = TimedExecutor(inner)
    try:
        samples: list[StepSample] = []
        for r in range(repeats):
            samples += measure_grid(engine, contexts, decode_batches, prefills,
                                    steps_per_sample=steps_per_sample,
                                    vocab_size=min(model.vocab_size, 256), seed=r, log=log)
    finally:
        engine.executor = inner
    where = f"{_cpu_name()}, {threads or os.cpu_count()} torch threads"
    source = (f"fitted by `llmtower simulate calibrate` on {platform.node()} ({where}) against "
              f"{model.name} ({model.dtype}) on {datetime.date.today().isoformat()}")
    profile, report = fit_device(samples, model, name, fit_seq_overhead,
                                 description=f"this CPU: {where}", source=source)
    cache = engine.scheduler.cache_config  # the engine's KV budget is the simulator's default
    kv_bytes = cache.num_blocks * cache.block_size * model.kv_bytes_per_token
    report["grid"] = {"contexts": list(contexts), "decode_batches": list(decode_batches),
                      "prefills": list(prefills), "repeats": repeats,
                      "steps_per_sample": steps_per_sample}
    profile = replace(profile, calibration=report, default_kv_cache_bytes=float(kv_bytes))
    return profile, report, samples


def calibrate(engine_args, model: ModelProfile, **kw):
    """Build the real engine from ``engine_args``, calibrate it, shut it down."""
    try:
        from llmtower.engine.factory import create_engine_core
    except ImportError as e:
        raise RuntimeError("calibration needs the real CPU executor "
                           f"(llmtower.engine.factory.create_engine_core): {e}") from None
    engine = create_engine_core(engine_args)
    try:
        return calibrate_engine(engine, model, threads=engine_args.threads, **kw)
    finally:
        engine.shutdown()


def run_cli(args: argparse.Namespace) -> int:
    from llmtower.engine.args import EngineArgs
    from llmtower.bench.synthetic import is_synthetic_model, synthetic_model_dir
    if is_synthetic_model(args.model):  # e.g. w1: built on first use, profiled by name
        if args.model_profile is None:
            args.model_profile = args.model.lower()
        args.model = str(synthetic_model_dir(args.model))
    engine_args = EngineArgs.from_cli_args(args)
    model = model_profile_for(args, engine_args)
    profile, report, samples = calibrate(
        engine_args, model, contexts=_ints(args.contexts, "contexts"),
        decode_batches=_ints(args.decode_batches, "decode-batches"),
        prefills=_ints(args.prefills, "prefills"), repeats=args.repeats,
        steps_per_sample=args.steps_per_sample, name=args.name,
        fit_seq_overhead=not args.no_seq_overhead, log=lambda m: print(m, file=sys.stderr))
    out = save_profile(profile, args.output or user_profile_dir() / f"{args.name}.json")
    if args.save_samples:
        save_samples(samples, args.save_samples)
    print(f"effective compute    {profile.peak_flops / 1e9:10.2f} GFLOP/s")
    print(f"effective bandwidth  {profile.mem_bandwidth / 1e9:10.2f} GB/s")
    print(f"per-step overhead    {profile.step_overhead_s * 1e3:10.3f} ms")
    print(f"per-request overhead {profile.seq_overhead_s * 1e6:10.1f} us")
    combine = "overlap (max)" if profile.overlap == "max" else "take turns (sum)"
    print(f"compute and memory   {combine:>16}")
    print(f"fit over {report['points_used']}/{report['points']} steps: mean |error| "
          f"{100 * report['mean_abs_rel_err']:.1f}%, max {100 * report['max_abs_rel_err']:.1f}%")
    print(f"wrote {out}")
    return 0
