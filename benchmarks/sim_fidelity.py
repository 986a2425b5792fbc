"""Simulator fidelity: the real engine and the simulator on the same trace, on this CPU.

1. Build the W1 model (random-weight Llama: hidden 768, 8 layers, 12 heads, vocab 16384,
   float32) and the real in-process EngineCore (create_engine_core, CPU executor).
2. Calibrate the "cpu" device profile on that engine (the grid of `llmtower simulate
   calibrate`), unless --profile gives one.
3. Replay a Poisson trace (default: 64 requests at 4 req/s, prompts uniform 32-256, 128 output
   tokens, ignore_eos) through the real engine in wall-clock time: a request is added at the
   first step boundary after its arrival, as a serving engine does.
4. Simulate the same trace with the calibrated profile, the W1 model profile and the real
   engine's KV-cache size and scheduler settings.
5. Print both and the relative differences; the acceptance target is request throughput and
   mean TTFT within 15%.

    python benchmarks/sim_fidelity.py [--rate 4] [--num-requests 64] [--threads 2] \
        [--profile cpu.json] [--save-profile out.json] [--json result.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from llmtower.bench.synthetic import synthetic_model_dir
from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.sim.calibrate import calibrate_engine, save_samples
from llmtower.sim.metrics import latency_stats, tpot_seconds
from llmtower.sim.profiles import load_device, load_model, save_profile
from llmtower.sim.prompts import PromptFactory
from llmtower.sim.report import build_result
from llmtower.sim.simulator import SimConfig, Simulator
from llmtower.sim.workload_gen import WorkloadSpec, generate


class OthersCpu:
    """Owns the share of the machine's CPU time other processes took while a block ran: on a
    shared machine a real-engine timing is only as good as the CPU it actually got."""

    def __enter__(self) -> "OthersCpu":
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_s(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t0
        others = (_busy_s() - self.busy0) - (time.process_time() - self.own0)
        self.share = max(0.0, others) / (wall * (os.cpu_count() or 1))


def _busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def run_real(engine, trace, seed: int) -> dict:
    """Replay ``trace`` through the real engine in wall-clock time."""
    prompts = PromptFactory(seed)
    reqs = [EngineCoreRequest(tr.request_id, prompts.token_ids(tr), SamplingParams(
        max_tokens=tr.output_len, ignore_eos=True, temperature=0.0)) for tr in trace]
    arrival = {tr.request_id: tr.arrival_time for tr in trace}
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    ntok: dict[str, int] = {}
    i = 0
    start = time.perf_counter()
    while i < len(reqs) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while i < len(reqs) and trace[i].arrival_time <= now:
            engine.add_request(reqs[i])
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, trace[i].arrival_time - now))
            continue
        outs = engine.step().outputs
        t = time.perf_counter() - start
        for o in outs:
            rid = o.request_id
            first.setdefault(rid, t)
            ntok[rid] = ntok.get(rid, 0) + len(o.new_token_ids)
            if o.finish_reason is not None:
                finish[rid] = t
    ids = [tr.request_id for tr in trace]
    ttft = np.array([first[r] - arrival[r] for r in ids])
    e2e = np.array([finish[r] - arrival[r] for r in ids])
    out = np.array([ntok[r] for r in ids])
    duration = max(finish.values()) - min(arrival.values())
    return {"completed": len(finish), "duration_s": duration,
            "request_throughput": len(finish) / duration,
            "output_throughput": int(out.sum()) / duration,
            "ttft_ms": latency_stats(ttft), "tpot_ms": latency_stats(tpot_seconds(ttft, e2e, out)),
            "e2el_ms": latency_stats(e2e), "num_preemptions": engine.scheduler.num_preemptions}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--input-len", default="uniform:32-256")
    ap.add_argument("--output-len", default="128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, help="use this cpu profile instead of calibrating")
    ap.add_argument("--repeats", type=int, default=1, help="calibration grid repeats")
    ap.add_argument("--save-profile", default=None, help="write the calibrated profile here")
    ap.add_argument("--save-samples", default=None, help="write the calibration steps here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    print(f"load average {os.getloadavg()[0]:.1f}; building W1 and the real engine", flush=True)
    from llmtower.engine.factory import create_engine_core
    engine_args = EngineArgs(model=str(synthetic_model_dir("w1")), num_threads=args.threads,
                             seed=args.seed, enable_prefix_caching=False)
    engine = create_engine_core(engine_args)
    model = load_model("w1")
    if args.profile:
        device = load_device(args.profile)
    else:
        t0 = time.perf_counter()
        with OthersCpu() as cal_cpu:
            device, report, samples = calibrate_engine(engine, model, repeats=args.repeats,
                                                       threads=args.threads,
                                                       log=lambda m: print("  " + m, flush=True))
        if args.save_samples:
            save_samples(samples, args.save_samples)
        print(f"other processes used {100 * cal_cpu.share:.0f}% of the CPU meanwhile")
        print(f"calibrated in {time.perf_counter() - t0:.0f} s: {device.peak_flops / 1e9:.1f} "
              f"GFLOP/s, {device.mem_bandwidth / 1e9:.2f} GB/s ({device.overlap}), step "
              f"{device.step_overhead_s * 1e3:.2f} "
              f"ms + {device.seq_overhead_s * 1e6:.0f} us/request; fit mean |err| "
              f"{100 * report['mean_abs_rel_err']:.1f}% over {report['points_used']} steps",
              flush=True)
        if args.save_profile:
            save_profile(device, args.save_profile)

    trace = generate(WorkloadSpec(num_requests=args.num_requests, rate=args.rate,
                                  input_len=args.input_len, output_len=args.output_len,
                                  seed=args.seed))
    print(f"real engine: {len(trace)} requests, Poisson {args.rate}/s ...", flush=True)
    with OthersCpu() as real_cpu:
        real = run_real(engine, trace, args.seed)
    print(f"other processes used {100 * real_cpu.share:.0f}% of the CPU meanwhile")
    sched = engine.scheduler
    sim_engine = EngineArgs(seed=args.seed, enable_prefix_caching=False,
                            num_gpu_blocks=sched.cache_config.num_blocks,
                            max_model_len=sched.config.max_model_len,
                            max_num_seqs=sched.config.max_num_seqs,
                            max_num_batched_tokens=sched.config.max_num_batched_tokens)
    engine.shutdown()
    simulator = Simulator(SimConfig(engine=sim_engine, device=device, model=model))
    sim = build_result(simulator.run(trace)).summary

    rows = [("request throughput (req/s)", real["request_throughput"], sim["request_throughput"]),
            ("output throughput (tok/s)", real["output_throughput"], sim["output_throughput"]),
            ("mean TTFT (ms)", real["ttft_ms"]["mean"], sim["ttft_ms"]["mean"]),
            ("median TTFT (ms)", real["ttft_ms"]["median"], sim["ttft_ms"]["median"]),
            ("mean TPOT (ms)", real["tpot_ms"]["mean"], sim["tpot_ms"]["mean"]),
            ("mean E2E (ms)", real["e2el_ms"]["mean"], sim["e2el_ms"]["mean"]),
            ("duration (s)", real["duration_s"], sim["duration_s"])]
    print(f"{'':<28}{'real':>12}{'simulated':>12}{'diff':>9}")
    for name, r, s in rows:
        print(f"{name:<28}{r:>12.2f}{s:>12.2f}{100 * (s - r) / r:>8.1f}%")
    real_thr = real["request_throughput"]
    thr_err = abs(sim["request_throughput"] - real_thr) / real_thr
    ttft_err = abs(sim["ttft_ms"]["mean"] - real["ttft_ms"]["mean"]) / real["ttft_ms"]["mean"]
    ok = thr_err <= 0.15 and ttft_err <= 0.15
    print(f"throughput within {100 * thr_err:.1f}%, mean TTFT within {100 * ttft_err:.1f}% "
          f"(target 15%): {'PASS' if ok else 'FAIL'}; load average {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device.to_json(), "real": real,
                       "simulated": sim, "others_cpu_share": real_cpu.share}, f, indent=1,
                      default=float)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
