"""Two tenants on a live `llmtower serve`, one sending 10x the other's rate at 2x what the
server completes, under --policy fcfs and --policy fair: each tenant's p99 TTFT, next to the
light tenant alone (unloaded), and the same shape in the simulator.

    python benchmarks/tenant_fairness.py [--model DIR] [--duration 30] [--max-num-seqs 2]

Without --model it builds the tests' tiny random-weight Llama (tests/fixtures). Steps:
  1. capacity: a burst of 8 x max_num_seqs requests on an fcfs server -> C requests/s;
  2. unloaded: the light tenant alone at 2C/11 req/s -> its p99 TTFT;
  3. overload, per policy: heavy at 20C/11 and light at 2C/11 req/s (Poisson) for --duration s;
  4. the simulator (device cpu, model smollm2-135m) with the same request shape, tenant mix and
     relative load (2x its own saturated throughput).
Prints one table; the machine's load average is printed beside it. TTFT is the server's own
(`include_metrics`), requests are not streamed (see `one`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "server")]

PROMPT_WORDS = 20  # about 24 tokens with the tiny tokenizer
MAX_NUM_SEQS = 2  # set from --max-num-seqs
OUTPUT_LEN = 128


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


async def one(client: httpx.AsyncClient, tenant: str, rng: random.Random) -> float:
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega", "sigma"])
                     for _ in range(PROMPT_WORDS))
    # Not streamed: with the tiny model the engine steps in under a millisecond, and 128 SSE
    # chunks per request would make the HTTP front end, not the scheduler, the bottleneck.
    # The TTFT is the server's own (include_metrics: arrival at the API to the first token).
    body = {"model": "tiny", "prompt": words, "max_tokens": OUTPUT_LEN, "ignore_eos": True,
            "temperature": 0, "include_metrics": True}
    r = await client.post("/v1/completions", json=body, headers={"X-Tenant": tenant})
    r.raise_for_status()
    return r.json()["metrics"]["ttft_ms"] / 1000


async def offered_load(url: str, rates: dict[str, float], duration: float, seed: int) -> dict:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        tasks: list[tuple[str, asyncio.Task]] = []

        async def tenant_loop(t: str, rate: float) -> None:
            end = time.perf_counter() + duration
            while True:
                await asyncio.sleep(rng.expovariate(rate))
                if time.perf_counter() > end:
                    return
                tasks.append((t, asyncio.create_task(one(client, t, rng))))

        await asyncio.gather(*(tenant_loop(t, r) for t, r in rates.items()))
        out: dict[str, list[float]] = {t: [] for t in rates}
        failed = 0
        for t, task in tasks:
            try:
                out[t].append(await task)
            except httpx.HTTPError:
                failed += 1  # counted, not hidden: printed with the results
        if failed:
            print(f"  {failed} of {len(tasks)} requests failed (connection errors)")
    return out


async def capacity(url: str, n: int) -> float:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, "cal", rng) for _ in range(n)))
        return n / (time.perf_counter() - t0)


def serve(model: str, policy: str, max_num_seqs: int, log: Path):
    from server_process import ServerProcess
    return ServerProcess(["--model", model, "--served-model-name", "tiny", "--num-threads", "1",
                          "--max-model-len", "512", "--num-gpu-blocks", "1024",
                          "--max-num-seqs", str(max_num_seqs), "--policy", policy], log).start()


def simulate(duration: float) -> dict:
    """The same shape in the simulator: saturated throughput first, then 2x of it for the same
    duration as the real run."""
    cmd = [sys.executable, "-m", "llmtower.cli.main", "simulate", "run", "--device", "cpu",
           "--model", "smollm2-135m", "--input-len", "fixed:24", "--output-len",
           f"fixed:{OUTPUT_LEN}", "--max-num-seqs", str(MAX_NUM_SEQS), "--disable-progress"]
    out_dir = Path(tempfile.mkdtemp())

    def run(extra: list[str], name: str) -> dict:
        path = out_dir / f"{name}.json"
        subprocess.run(cmd + extra + ["--output-json", str(path)], check=True,
                       capture_output=True)
        return json.loads(path.read_text())

    sat = run(["--num-requests", "400", "--rate", "inf"], "sat")
    cap = sat["results"][0]["summary"]["request_throughput"] if "results" in sat else \
        sat["summary"]["request_throughput"]
    rows = {}
    num_requests = max(22, round(2 * cap * duration))
    light_alone = run(["--num-requests", str(max(2, num_requests // 11)), "--rate",
                       f"{2 * cap / 11:.4f}", "--tenants", "light:1"], "alone")
    rows["unloaded"] = _sim_p99(light_alone, ["light"])
    for policy in ("fcfs", "fair"):
        res = run(["--num-requests", str(num_requests), "--rate", f"{2 * cap:.4f}",
                   "--tenants", "heavy:10,light:1", "--policy", policy], policy)
        rows[policy] = _sim_p99(res, ["heavy", "light"])
    rows["capacity_req_s"] = cap
    return rows


def _sim_p99(payload: dict, tenants: list[str]) -> dict:
    res = payload["results"][0] if "results" in payload else payload
    return {t: res["by_tenant"][t]["ttft_ms"]["p99"] / 1000 for t in tenants}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--no-sim", action="store_true")
    args = ap.parse_args()
    global MAX_NUM_SEQS
    MAX_NUM_SEQS = args.max_num_seqs
    model = args.model
    if model is None:
        from tests.fixtures.tiny_models import make_tiny_model_dir

        class _Tmp:
            @staticmethod
            def mktemp(name: str) -> Path:
                return Path(tempfile.mkdtemp(prefix=name))
        model = str(make_tiny_model_dir(_Tmp(), "llama"))
    logs = Path(tempfile.mkdtemp())
    print(f"load average before: {os.getloadavg()}")
    rows: dict[str, dict] = {}
    server = serve(model, "fcfs", args.max_num_seqs, logs / "fcfs.log")
    try:
        cap = asyncio.run(capacity(server.base_url, 8 * args.max_num_seqs))
        light, heavy = 2 * cap / 11, 20 * cap / 11
        print(f"capacity {cap:.2f} req/s; offered: heavy {heavy:.2f} + light {light:.2f} req/s")
        alone = asyncio.run(offered_load(server.base_url, {"light": light}, args.duration, 1))
        rows["unloaded"] = {"light": p99(alone["light"]), "n": len(alone["light"])}
        res = asyncio.run(offered_load(server.base_url, {"heavy": heavy, "light": light},
                                       args.duration, 2))
        rows["fcfs"] = {t: p99(v) for t, v in res.items()}
    finally:
        server.stop()
    server = serve(model, "fair", args.max_num_seqs, logs / "fair.log")
    try:
        res = asyncio.run(offered_load(server.base_url, {"heavy": heavy, "light": light},
                                       args.duration, 2))
        rows["fair"] = {t: p99(v) for t, v in res.items()}
    finally:
        server.stop()
    print(f"load average after: {os.getloadavg()}")
    sim = None if args.no_sim else simulate(args.duration)
    print(f"\n{'p99 TTFT (s)':<22}{'real heavy':>12}{'real light':>12}"
          + ("" if sim is None else f"{'sim heavy':>12}{'sim light':>12}"))
    for name in ("unloaded", "fcfs", "fair"):
        r = rows[name]
        line = f"{name:<22}{r.get('heavy', float('nan')):>12.3f}{r['light']:>12.3f}"
        if sim is not None:
            s = sim[name]
            line += f"{s.get('heavy', float('nan')):>12.3f}{s['light']:>12.3f}"
        print(line)
    base = rows["unloaded"]["light"]
    print(f"\nlight p99 / unloaded: real fcfs {rows['fcfs']['light'] / base:.1f}x, "
          f"fair {rows['fair']['light'] / base:.1f}x"
          + ("" if sim is None else
             f"; sim fcfs {sim['fcfs']['light'] / sim['unloaded']['light']:.1f}x, "
             f"fair {sim['fair']['light'] / sim['unloaded']['light']:.1f}x"))


if __name__ == "__main__":
    main()
