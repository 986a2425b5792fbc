"""`llmtower simulate run|calibrate`: the scheduler at cluster scale on a virtual clock.

    llmtower simulate run --device h100 --model llama-3-8b --rate 20 --num-requests 2000 \
        --num-replicas 2 --compare policy=fcfs,priority,sjf --priority-mix 0:1,1:3 \
        --slo ttft:500 tpot:50 --plot out.png --output-json out.json
    llmtower simulate calibrate --model /path/to/hf_model_dir
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
from dataclasses import fields

from llmtower.engine.args import EngineArgs
from llmtower.engine.vllm_compat import VLLM_ONLY_FIELDS

# Engine settings that mean nothing to a simulation (the model is a profile, threads are not
# simulated, data parallelism is --num-replicas, KV memory is sized per device below).
_SKIP_ENGINE_ARGS = ("model", "tokenizer", "served_model_name", "dtype", "num_threads",
                     "cpu_bind", "attention_backend",
                     "data_parallel_size", "kv_cache_memory", *VLLM_ONLY_FIELDS)
# Flags that define the workload or the outputs: --compare must not vary them, so every
# variant replays the same trace.
_NOT_COMPARABLE = {"trace", "rate", "num_requests", "burstiness", "input_len", "output_len",
                   "priority_mix", "tenants", "num_prefix_groups", "prefix_len", "seed",
                   "save_trace", "compare", "plot", "output_json", "handler", "command",
                   "disable_progress",
                   "simulate_command"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Says each flag's default, except where there is none (no "(default: None)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def register(sub) -> None:
    p = sub.add_parser("simulate", help="simulate the real scheduler at cluster scale on a "
                       "virtual clock, or calibrate the CPU profile")
    ssub = p.add_subparsers(dest="simulate_command", required=True)
    run_p = ssub.add_parser(
        "run", help="replay a trace or a synthetic workload through simulated replicas",
        formatter_class=_DefaultsFormatter)
    add_run_args(run_p)
    run_p.set_defaults(handler=lambda a: run(a, run_p))
    cal_p = ssub.add_parser("calibrate", help="measure the real CPU executor and fit the "
                            "'cpu' device profile")
    from llmtower.sim import calibrate
    calibrate.add_cli_args(cal_p)
    cal_p.set_defaults(handler=calibrate.run_cli)


def add_run_args(p: argparse.ArgumentParser) -> None:
    hw = p.add_argument_group("hardware and cluster")
    hw.add_argument("--device", default="h100",
                    help="device profile: h100, h200, a100, l4, cpu, or a JSON profile file")
    hw.add_argument("--model", default="llama-3-8b",
                    help="model profile: llama-3-8b, llama-3-70b, qwen2.5-7b, smollm2-135m, w1, "
                         "a JSON profile file, or a Hugging Face model directory (config.json)")
    hw.add_argument("--tensor-parallel-size", type=int, default=1)
    hw.add_argument("--num-replicas", type=int, default=1,
                    help="data-parallel replicas, each with its own scheduler and KV cache")
    hw.add_argument("--load-balancer", default="round_robin",
                    choices=["round_robin", "least_loaded", "coordinator",
                             "coordinator_no_prefix"],
                    help="how requests are spread over replicas: 'coordinator' is llmtower "
                         "serve's own data-parallel router (real load + prefix affinity)")
    hw.add_argument("--workers", type=int, default=1,
                    help="processes the replicas are split over (results do not depend on it; "
                         "state-reading balancers need --routing-interval)")
    hw.add_argument("--routing-interval", type=float, default=0.0, metavar="SECONDS",
                    help="route on the replicas' state as of the last multiple of this many "
                         "simulated seconds, as the real head does with its engines' stats "
                         "snapshots (0.5 s there); 0: their state at each arrival (1 worker)")
    hw.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="fraction of device memory for weights + KV cache")
    hw.add_argument("--kv-cache-memory", default=None,
                    help="KV cache per tensor-parallel rank, e.g. 20GiB (default: device memory "
                         "x utilization - weights); --num-gpu-blocks overrides it")
    wl = p.add_argument_group("workload")
    wl.add_argument("--trace", default=None, help="JSONL trace file (see docs/simulator.md)")
    wl.add_argument("--rate", type=float, default=math.inf,
                    help="arrivals per second (inf: all at 0)")
    wl.add_argument("--num-requests", type=int, default=1000)
    wl.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of inter-arrival times (1: Poisson, < 1: burstier)")
    wl.add_argument("--input-len", default="uniform:32-512",
                    help="prompt length: N, uniform:LO-HI, lognormal:MEAN,SIGMA or sharegpt")
    wl.add_argument("--output-len", default="uniform:16-256", help="output length (same syntax)")
    wl.add_argument("--priority-mix", default=None, help="priorities and weights, e.g. 0:1,1:3")
    wl.add_argument("--tenants", default=None, help="tenants and weights, e.g. a:1,b:1")
    wl.add_argument("--num-prefix-groups", type=int, default=0,
                    help="requests share one of N prompt prefixes (0: no sharing)")
    wl.add_argument("--prefix-len", type=int, default=256, help="length of a shared prefix")
    wl.add_argument("--save-trace", default=None, help="write the generated trace as JSONL")
    wl.add_argument("--oracle-output-len", action=argparse.BooleanOptionalAction, default=True,
                    help="give each request max_tokens = its true output length (the scheduler "
                    "then knows it); --no-oracle-output-len leaves max_tokens open and ends each "
                    "request with an EOS, so sjf must predict lengths online")
    out = p.add_argument_group("output")
    out.add_argument("--compare", default=None, metavar="FIELD=V1,V2,...",
                     help="run one variant per value of any engine/cluster setting on the same "
                          "trace and print one table, e.g. policy=fcfs,priority,sjf")
    out.add_argument("--slo", nargs="+", default=None, metavar="METRIC:MS",
                     help="goodput objectives: ttft:MS tpot:MS e2el:MS")
    out.add_argument("--plot", default=None, help="PNG with latency CDFs and timelines")
    out.add_argument("--output-json", default=None, help="save every result as JSON")
    out.add_argument("--disable-progress", action="store_true",
                     help="no progress bar (it is written to stderr, simulated time against "
                     "the trace's last arrival)")
    EngineArgs.add_cli_args(p, skip=_SKIP_ENGINE_ARGS)


# ---------------------------------------------------------------------- config
def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    # Our --kv-cache-memory is per device rank and defaults to "size from the device"; it is
    # not EngineArgs' CPU budget, so it stays out of EngineArgs.
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs)
                         if f.name not in _SKIP_ENGINE_ARGS and hasattr(ns, f.name)})


def sim_config_from(ns: argparse.Namespace):
    from llmtower.sim.metrics import SLO
    from llmtower.sim.simulator import SimConfig
    return SimConfig(engine=engine_args_from(ns), device=ns.device, model=ns.model,
                     tensor_parallel_size=ns.tensor_parallel_size, num_replicas=ns.num_replicas,
                     load_balancer=ns.load_balancer,
                     gpu_memory_utilization=ns.gpu_memory_utilization,
                     kv_cache_memory=ns.kv_cache_memory, prefix_len=ns.prefix_len,
                     slo=SLO.parse(ns.slo), oracle_output_len=ns.oracle_output_len,
                     workers=ns.workers, routing_interval=ns.routing_interval)


def load_trace(ns: argparse.Namespace):
    from llmtower.sim.workload import read_trace, write_trace
    from llmtower.sim.workload_gen import WorkloadSpec, generate
    if ns.trace:
        trace = read_trace(ns.trace)
    else:
        trace = generate(WorkloadSpec(
            num_requests=ns.num_requests, rate=ns.rate, burstiness=ns.burstiness,
            input_len=ns.input_len, output_len=ns.output_len, priority_mix=ns.priority_mix,
            tenants=ns.tenants, num_prefix_groups=ns.num_prefix_groups, prefix_len=ns.prefix_len,
            seed=ns.seed))
    if ns.save_trace:
        write_trace(trace, ns.save_trace)
    return trace


def parse_compare(spec: str, ns: argparse.Namespace) -> tuple[str, list[str]]:
    field, sep, values = spec.partition("=")
    field = field.strip().lstrip("-").replace("-", "_")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not field or not vals:
        raise ValueError(f"cannot read --compare {spec!r}: use FIELD=V1,V2,... "
                         "(e.g. policy=fcfs,priority,sjf)")
    if field in _NOT_COMPARABLE:
        raise ValueError(f"--compare {field} is not allowed: it changes the workload or the "
                         "outputs, and every variant must replay the same trace")
    if not hasattr(ns, field):
        known = sorted(k for k in vars(ns) if k not in _NOT_COMPARABLE)
        raise ValueError(f"--compare: unknown setting {field!r}; comparable settings: "
                         f"{', '.join(known)}")
    return field, vals


def variant_namespace(parser: argparse.ArgumentParser, ns: argparse.Namespace, field: str,
                      value: str) -> argparse.Namespace:
    """``ns`` with one setting replaced, parsed by the same parser (types, choices and
    validation included) as if ``--field value`` had been given."""
    flag = "--" + field.replace("_", "-")
    if isinstance(getattr(ns, field), bool):
        v = value.lower()
        if v not in _TRUE | _FALSE:
            raise ValueError(f"--compare {field}: {value!r} is not a boolean (use true/false)")
        argv = [flag if v in _TRUE else "--no-" + field.replace("_", "-")]
    else:
        argv = [flag, value]
    return parser.parse_args(argv, namespace=copy.copy(ns))


class _ProgressBar:
    """A tqdm bar over the requests of one simulation, on stderr, that also shows the
    simulated clock against the trace's last arrival (the end of the offered load)."""

    def __init__(self, trace, desc: str, disable: bool) -> None:
        from tqdm.auto import tqdm
        self.trace_end = trace[-1].arrival_time if trace else 0.0
        self.bar = tqdm(total=len(trace), desc=desc, unit="req", file=sys.stderr,
                        disable=disable, dynamic_ncols=True, leave=False)

    def update(self, simulated_now: float, num_done: int) -> None:
        self.bar.n = num_done
        end = f"{self.trace_end:.1f}" if math.isfinite(self.trace_end) else "0"
        self.bar.set_postfix_str(f"simulated {simulated_now:.1f} s / trace end {end} s",
                                 refresh=False)
        self.bar.refresh()

    def __enter__(self) -> _ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


# ---------------------------------------------------------------------- command
def run(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from llmtower.sim.report import build_result, format_compare_table, format_result, save_json
    from llmtower.sim.simulator import Simulator
    trace = load_trace(ns)
    if ns.compare:
        field, values = parse_compare(ns.compare, ns)
        variants = [(v, variant_namespace(parser, ns, field, v)) for v in values]
    else:
        field, variants = "", [("", ns)]
    results = []
    for label, vns in variants:
        sim = Simulator(sim_config_from(vns))
        with _ProgressBar(trace, f"{field}={label}" if field else "simulating",
                          ns.disable_progress) as bar:
            stats = sim.run(trace, progress=bar.update)
        res = build_result(stats)
        results.append((label, res))
        if res.summary["unfinished"]:
            print(f"warning: {res.summary['unfinished']} requests never finished"
                  f"{' (' + field + '=' + label + ')' if field else ''}", file=sys.stderr)
        if field:
            print(f"{field}={label}: {res.summary['completed']} requests, simulated in "
                  f"{res.summary['wall_s']:.1f} s", file=sys.stderr)
    if field:
        print(format_compare_table(field, results))
    else:
        print(format_result(results[0][1]))
    if ns.output_json:
        payload = (results[0][1].to_json() if not field else
                   {"compare": field, "variants": {lab: r.to_json() for lab, r in results}})
        save_json(payload, ns.output_json)
        print(f"saved {ns.output_json}", file=sys.stderr)
    if ns.plot:
        from llmtower.sim.plot import plot_results
        plot_results([(f"{field}={lab}" if field else "run", r) for lab, r in results], ns.plot)
        print(f"saved {ns.plot}", file=sys.stderr)
    return 0
