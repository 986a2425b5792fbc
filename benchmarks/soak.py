"""Soak benchmark: does `llmtower serve` hold its memory over thousands of requests?

Starts `llmtower serve` (the default model unless --model), sends --requests completions with
varied prompt lengths and max_tokens (so that every engine step sees a different token count,
the shape oneDNN keys its caches by), --concurrency at a time, and prints the resident memory
(RSS) of the API process and of the engine process after every --report-every requests, then
the growth per 1,000 requests after the first report (the warm-up).

    python benchmarks/soak.py --requests 3000                       # the default model
    python benchmarks/soak.py --model /path/to/hf_dir --requests 3000 -- --dtype bfloat16
    python benchmarks/soak.py --requests 3000 --env LLMTOWER_ONEDNN_CACHE_CAPACITY=1024

Arguments after `--` go to `llmtower serve`. The target (issue 11): under 5 MiB per 1,000
requests for each process after warm-up.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly mix "
         "bright potions for the sleepy king of some distant mountain town").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, serve_args: list[str], env: dict[str, str],
                 log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "llmtower.cli.main", "serve", "--port", str(port),
           "--served-model-name", "soak", *(["--model", model] if model else []), *serve_args]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **env}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not start in 600 s")


def engine_pid(log: Path) -> int:
    m = re.search(r"engine core process started \(pid (\d+)\)", log.read_text())
    if not m:
        raise SystemExit("no engine pid in the server log")
    return int(m.group(1))


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def one_request(base: str, rng: random.Random, max_words: int) -> int:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, max_words)))
    body = {"model": "soak", "prompt": prompt, "max_tokens": rng.randint(1, 24),
            "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    return r.status_code


def main() -> None:
    argv = sys.argv[1:]
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model to serve (default: the default model)")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--report-every", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-words", type=int, default=300, help="longest prompt, in words")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment of the server (e.g. LLMTOWER_ONEDNN_CACHE_CAPACITY=1024)")
    args = p.parse_args(argv)
    env = dict(e.split("=", 1) for e in args.env)
    log = Path(tempfile.mkdtemp(prefix="llmtower-soak-")) / "server.log"
    proc, base = start_server(args.model, serve_args, env, log)
    try:
        api, engine = proc.pid, engine_pid(log)
        print(f"# load {os.getloadavg()[0]:.1f}; env {env or '{}'}; serve {serve_args}")
        print(f"{'requests':>8} {'api MiB':>9} {'engine MiB':>11} {'errors':>7} {'s':>7}")
        rows = [(0, rss_mib(api), rss_mib(engine))]
        print(f"{0:>8} {rows[0][1]:>9.1f} {rows[0][2]:>11.1f} {0:>7} {0:>7.1f}")
        rng = random.Random(args.seed)
        errors, done, start = 0, 0, time.monotonic()
        with cf.ThreadPoolExecutor(args.concurrency) as pool:
            while done < args.requests:
                n = min(args.report_every, args.requests - done)
                seeds = [rng.random() for _ in range(n)]
                for status in pool.map(lambda s: one_request(base, random.Random(s), args.max_words), seeds):
                    errors += status != 200
                done += n
                rows.append((done, rss_mib(api), rss_mib(engine)))
                print(f"{done:>8} {rows[-1][1]:>9.1f} {rows[-1][2]:>11.1f} {errors:>7} "
                      f"{time.monotonic() - start:>7.1f}", flush=True)
        if len(rows) >= 3:
            (n0, a0, e0), (n1, a1, e1) = rows[1], rows[-1]
            per_k = 1000 / (n1 - n0)
            print(f"# after warm-up ({n0} requests): api {(a1 - a0) * per_k:+.1f} MiB / 1k "
                  f"requests, engine {(e1 - e0) * per_k:+.1f} MiB / 1k requests; "
                  f"load {os.getloadavg()[0]:.1f}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
