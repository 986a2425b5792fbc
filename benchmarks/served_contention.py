"""Threads under contention (issue 9): a *served* stream and offline W1 throughput, quiet and
beside busy neighbours, as ratios measured in one run.

Part 1 starts the real server (``llmtower serve`` at its defaults unless ``--serve-args`` says
otherwise, SmolLM2), and sends one streamed greedy completion at a time (144 prompt tokens as
ids, ``--output-len`` out, EOS ignored): without a neighbour, then with each neighbour, taking
turns ``--rounds`` times. Part 2 builds the W1 engine in this process at its default threads and
runs the 64-prompt W1 workload without and with the ``spin`` neighbour. Targets: a served stream
keeps >= 0.6x of its quiet speed, W1 >= 0.45x.

Neighbours (each in its own session, as another service on the host would be):
  spin       python3 -c 'while 1: pass'        (the issue's neighbour)
  monotonic  a loop calling time.monotonic()   (did not show the collapse in the issue)
  gemm       numpy 256x256 matmuls, one BLAS thread
  sleepy     busy 9 ms, asleep 1 ms
  two        two spin loops

Every process started here (server, neighbours) runs in its own process group and is killed on
the way out, Ctrl-C included. "Quiet" means "without our neighbour": each figure is printed with
the load average and the share of the CPU other processes took while it ran.

    .venv/bin/python benchmarks/served_contention.py                  # everything (~5 min quiet)
    .venv/bin/python benchmarks/served_contention.py --neighbours spin --skip-w1 --rounds 1
    .venv/bin/python benchmarks/served_contention.py --also "--num-threads 2" --also "--cpu-bind auto"
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serving import free_port, stop_server  # type: ignore[import-not-found]

NEIGHBOURS: dict[str, list[str]] = {
    "spin": ["while 1: pass"],
    "monotonic": ["import time\nwhile 1: time.monotonic()"],
    "gemm": ["import numpy as np\na = np.random.rand(256, 256)\nwhile 1: a @ a"],
    "sleepy": ["import time\nwhile 1:\n    t = time.monotonic() + 0.009\n"
               "    while time.monotonic() < t: pass\n    time.sleep(0.001)"],
    "two": ["while 1: pass", "while 1: pass"],
}
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--serve-args", default="", help="extra `llmtower serve` flags (default none)")
    p.add_argument("--also", action="append", default=[], metavar="SERVE_ARGS",
                   help="another server configuration measured the same way, after the first "
                   "(repeatable), e.g. --also '--num-threads 2' (the fixed team that collapses)")
    p.add_argument("--neighbours", default="spin,monotonic,gemm,sleepy,two",
                   help=f"comma-separated, from {', '.join(NEIGHBOURS)}")
    p.add_argument("--input-len", type=int, default=144)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--settle-s", type=float, default=1.0,
                   help="seconds between starting a neighbour and the request")
    p.add_argument("--skip-w1", action="store_true", help="leave out the offline W1 part")
    p.add_argument("--w1-num-prompts", type=int, default=64)
    p.add_argument("--w1-output-len", type=int, default=128)
    p.add_argument("--result-dir", default="/tmp/llmtower-contention")
    p.add_argument("--output-json", default=None)
    return p.parse_args()


# ---------------------------------------------------------------- processes we own
_OWNED: list[subprocess.Popen] = []


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


@contextmanager
def neighbour(name: str) -> Iterator[list[int]]:
    """Start the neighbour's processes (own sessions, like `setsid`); kill them on the way out."""
    procs = []
    try:
        for code in NEIGHBOURS[name]:
            p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                                 env={**os.environ, **_ONE_THREAD},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(p)
            _OWNED.append(p)
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            _kill_group(p)
            _OWNED.remove(p)


def _on_signal(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# ---------------------------------------------------------------- measurements
def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds used so far by these processes and their children (ours: server, engine)."""
    total, ticks = 0.0, os.sysconf("SC_CLK_TCK")
    seen = set()
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
            for task in os.listdir(f"/proc/{pid}/task"):  # children of any thread
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError, IndexError):
            continue
    return total


class Share:
    """The share of the machine's CPU that processes other than ``ours`` (the server and its
    engine, or this process, and the neighbour) took while a block ran: the noise of a shared
    machine, printed beside each figure."""

    def __init__(self, ours: list[int]) -> None:
        self.ours = ours

    def __enter__(self) -> Share:
        self.t0, self.busy0 = time.perf_counter(), _busy_seconds()
        self.own0 = _tree_cpu_seconds(self.ours) + time.process_time()
        self.load0 = os.getloadavg()[0]
        return self

    def __exit__(self, *_exc: object) -> None:
        wall = time.perf_counter() - self.t0
        busy = _busy_seconds() - self.busy0
        own = _tree_cpu_seconds(self.ours) + time.process_time() - self.own0
        self.others = max(0.0, busy - own) / (wall * (os.cpu_count() or 1))


def stream_once(client: httpx.Client, url: str, model: str, prompt: list[int],
                output_len: int) -> dict:
    """One streamed greedy completion; decode tok/s counts the chunks after the first."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    times: list[float] = []
    with client.stream("POST", url, json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    times.append(time.perf_counter())
    end = time.perf_counter()
    if len(times) < 2:
        raise RuntimeError(f"the stream returned {len(times)} text chunks")
    return {"ttft_s": times[0] - t0, "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
            "e2e_tok_s": output_len / (end - t0)}


def served_part(args: argparse.Namespace, serve_args: str, names: list[str]
                ) -> dict[str, list[dict]]:
    import numpy as np

    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    serve = ["--model", args.model, *shlex.split(serve_args)]
    print(f"starting `llmtower serve {' '.join(serve)}` on port {port}", flush=True)
    server = start_server(serve, port, out_dir / "server.log")
    res: dict[str, list[dict]] = {}
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        with httpx.Client() as client:
            model = client.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
            prompt = np.random.default_rng(0).integers(100, 40000, args.input_len).tolist()
            stream_once(client, url, model, prompt[:16], 8)  # warm-up
            for r in range(args.rounds):
                for cond in ["quiet", *names]:
                    with neighbour(cond) if cond != "quiet" else _nothing() as nb:
                        time.sleep(args.settle_s if cond != "quiet" else 0.2)
                        with Share([server.pid, *nb]) as sh:
                            m = stream_once(client, url, model, prompt, args.output_len)
                    m.update(load=sh.load0, others=sh.others)
                    res.setdefault(cond, []).append(m)
                    print(f"  round {r} {cond:9s}: decode {m['decode_tok_s']:6.1f} tok/s, "
                          f"TTFT {m['ttft_s'] * 1e3:6.0f} ms  (load {sh.load0:.1f}, others "
                          f"took {sh.others:.0%} of the CPU)", flush=True)
    finally:
        stop_server(server)
    return res


def start_server(serve: list[str], port: int, log: Path) -> subprocess.Popen:
    """`llmtower serve` in its own session, owned (killed on the way out) from its first moment."""
    cmd = [sys.executable, "-m", "llmtower.cli.main", "serve", "--port", str(port), *serve]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    _OWNED.append(proc)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not start in 600 s")


@contextmanager
def _nothing() -> Iterator[list[int]]:
    yield []


def w1_part(args: argparse.Namespace) -> dict[str, list[dict]]:
    from llmtower.bench import throughput as tp
    from llmtower.bench.synthetic import synthetic_model_dir
    from llmtower.core.sampling_params import SamplingParams
    from llmtower.engine.args import EngineArgs
    from llmtower.engine.factory import create_engine_core
    from llmtower.models.loader import load_model_config

    path = synthetic_model_dir("w1")
    ns = argparse.Namespace(seed=0, num_prompts=args.w1_num_prompts, input_len=0,
                            random_range_ratio=0.0, input_len_range="32:256")
    prompts = tp.make_prompts(ns, load_model_config(path).vocab_size)
    core = create_engine_core(EngineArgs(model=str(path), kv_cache_memory="2GiB",
                                         max_model_len=2048))  # default threads
    sp = SamplingParams(temperature=0.0, max_tokens=args.w1_output_len, ignore_eos=True)
    tp.run_engine(core, [prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4), "warm")
    res: dict[str, list[dict]] = {}
    try:
        for r in range(args.rounds):
            for cond in ("quiet", "spin"):
                core.reset_prefix_cache()
                with neighbour(cond) if cond != "quiet" else _nothing() as nb:
                    time.sleep(args.settle_s if cond != "quiet" else 0.2)
                    with Share([os.getpid(), *nb]) as sh:
                        elapsed, n = tp.run_engine(core, prompts, sp)
                m = {"tok_s": n / elapsed, "load": sh.load0, "others": sh.others}
                res.setdefault(cond, []).append(m)
                print(f"  round {r} {cond:9s}: {m['tok_s']:6.1f} output tok/s  (load "
                      f"{sh.load0:.1f}, others took {sh.others:.0%} of the CPU)", flush=True)
    finally:
        core.shutdown()
    return res


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    args = parse_args()
    if os.sched_getscheduler(0) != os.SCHED_OTHER:
        # The neighbours would inherit a real-time policy (chrt -f) and starve the server
        # and the client outright: a different experiment from "a busy process beside us".
        raise SystemExit("served_contention.py: run it without chrt (its neighbour processes "
                         "would inherit the real-time scheduling policy)")
    names = [n for n in args.neighbours.split(",") if n]
    bad = [n for n in names if n not in NEIGHBOURS]
    if bad:
        raise SystemExit(f"unknown neighbour(s) {bad}: choose from {', '.join(NEIGHBOURS)}")
    signal.signal(signal.SIGTERM, _on_signal)
    # Ctrl-C even where a shell started us with SIGINT ignored (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    load_start = os.getloadavg()
    report: dict = {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                    "load_start": load_start, "serve_args": args.serve_args}
    try:
        print(f"uptime load {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} on "
              f"{os.cpu_count()} CPUs", flush=True)
        report["served"] = {c: served_part(args, c, names) for c in [args.serve_args, *args.also]}
        if not args.skip_w1:
            print("W1 offline (64 prompts, 32-256 in, 128 out), default threads", flush=True)
            report["w1"] = w1_part(args)
    finally:
        for p in list(_OWNED):
            _kill_group(p)
    load_end = os.getloadavg()
    report["load_end"] = load_end
    for config, served in report["served"].items():
        quiet = _median(served["quiet"], "decode_tok_s")
        print(f"\nserved one stream (`llmtower serve --model {args.model} {config}`, "
              f"{args.input_len} in / {args.output_len} out, {args.rounds} rounds, medians); "
              f"load average {load_start[0]:.2f} -> {load_end[0]:.2f} on {os.cpu_count()} CPUs")
        print("| neighbour | decode tok/s | vs quiet | TTFT ms | others' CPU share |")
        print("|---|---|---|---|---|")
        for cond, rows in served.items():
            d = _median(rows, "decode_tok_s")
            print(f"| {cond} | {d:.1f} | {d / quiet:.2f}x | {_median(rows, 'ttft_s') * 1e3:.0f} "
                  f"| {_median(rows, 'others'):.0%} |")
    if "w1" in report:
        w1 = report["w1"]
        q, b = _median(w1["quiet"], "tok_s"), _median(w1["spin"], "tok_s")
        print(f"\nW1 offline, default threads: quiet {q:.1f} output tok/s, with spin {b:.1f} "
              f"({b / q:.2f}x; target >= 0.45x)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
