"""Served throughput and latency of `llmtower serve` beside its peers (llama.cpp's
llama-server, vLLM's OpenAI server), each alone, one after another, with one client for all:
`llmtower bench serve` (vLLM's `bench serve` metrics; random 128-token prompts, 64 tokens out,
EOS ignored, 64 requests). Per server:

- rate inf, cold: after a warm-up on other prompts (no prefix-cache hits): output tok/s, p99 TTFT
- rate inf, warm: the same prompts again: output tok/s
- 2 req/s (other prompts): p99 TTFT and median TPOT

then the engine's offline throughput on prompts of the same shape (`llmtower bench
throughput`) and the served/offline ratio. Peers that are not built here are skipped, saying
so. Run through benchmarks/served_vs_peers.sh (it says where the peers are looked for).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from served_runs import PYTHON, Server, bench, env, free_port, load

from llmtower.models.default_model import DEFAULT_MODEL_NAME

# The figures (issue 32, measured in another session on a quiet machine of this kind
# with vLLM's `bench serve`): tok/s cold, p99 TTFT cold (ms), tok/s warm, 2 req/s p99 TTFT (ms)
# and median TPOT (ms).
RECORDED = {
    "vllm serve (defaults: bfloat16)": (360, 4981, 343, 234, 20.4),
    "llama-server (BF16 GGUF, -np 64 -t 2)": (321, 6058, 675, 202, 53.5),
    "llmtower serve, before (float32 default)": (230, 7959, 363, 92, 22.0),
    "llmtower serve --dtype bfloat16, before": (364, 4235, 531, 49, 12.4),
}


class External:
    """Owns a peer server's process group (llama-server, vLLM) started on a free port."""

    def __init__(self, cmd: list[str], extra_env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                         env={**os.environ, **extra_env},
                                         start_new_session=True)
        deadline = time.time() + 900
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited:\n{log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{cmd[0]} did not start in 900 s")

    def model(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def measure(port: int, model: str, num_prompts: int) -> dict:
    tok = DEFAULT_MODEL_NAME
    bench(port, model, tok, "inf", seed=1, num_prompts=max(8, num_prompts // 4))  # warm-up
    cold = bench(port, model, tok, "inf", seed=0, num_prompts=num_prompts)
    warm = bench(port, model, tok, "inf", seed=0, num_prompts=num_prompts)
    rate2 = bench(port, model, tok, "2", seed=2, num_prompts=num_prompts)
    return {"cold_tok_s": cold["output_throughput"], "cold_p99_ttft": cold["ttft_ms"]["p99"],
            "warm_tok_s": warm["output_throughput"], "r2_p99_ttft": rate2["ttft_ms"]["p99"],
            "r2_median_tpot": rate2["tpot_ms"]["median"], "load": load()}


def offline(dtype_args: list[str], num_prompts: int) -> float:
    out = Path(tempfile.mkdtemp(prefix="llmtower-offline-")) / "r.json"
    subprocess.run([PYTHON, "-m", "llmtower.cli.main", "bench", "throughput", "--model",
                    DEFAULT_MODEL_NAME, "--num-prompts", str(num_prompts), "--input-len", "128",
                    "--output-len", "64", "--ignore-eos", "--disable-tqdm", "--seed", "0",
                    "--temperature", "0",  # greedy, as the served client's requests
                    "--output-json", str(out), *dtype_args], env=env(), check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["output_tokens_per_second"]


def row(name: str, m: dict) -> str:
    return (f"| {name} | {m['cold_tok_s']:.0f}, {m['cold_p99_ttft']:,.0f} ms | "
            f"{m['warm_tok_s']:.0f} | {m['r2_p99_ttft']:,.0f} ms / {m['r2_median_tpot']:.1f} ms "
            f"| {m['load']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--llama-server", default="", help="llama-server binary ('' : skip)")
    ap.add_argument("--llama-gguf", default="", help="SmolLM2 as a BF16 GGUF for llama-server")
    ap.add_argument("--vllm-python", default="", help="python of vLLM's venv ('': skip)")
    ap.add_argument("--hf-model", default="", help="SmolLM2's float32 folder, for vLLM")
    ap.add_argument("--serve-args", default="", help="more flags for both llmtower rows")
    args = ap.parse_args()
    extra = args.serve_args.split()
    results: dict[str, dict] = {}
    ours = [("llmtower serve (defaults)", []), ("llmtower serve --dtype bfloat16",
                                                ["--dtype", "bfloat16"])]
    for name, flags in ours:
        if flags and next(iter(results), "").endswith(": bfloat16"):
            continue  # the defaults already served bfloat16 (--dtype auto on this CPU)
        server = Server(["--model", DEFAULT_MODEL_NAME, *flags, *extra])
        try:
            found = re.search(r"serving \S+ in (\w+)", server.log.read_text())
            chose = found.group(1) if found else "?"
            results[f"{name}: {chose}"] = measure(server.port, DEFAULT_MODEL_NAME,
                                                  args.num_prompts)
        finally:
            server.stop()
        print(row(f"{name}: {chose}", results[f"{name}: {chose}"]), flush=True)
    logs = Path(tempfile.mkdtemp(prefix="peers-"))
    peers = []
    if args.llama_server and Path(args.llama_server).is_file() and Path(args.llama_gguf).is_file():
        peers.append(("llama-server (BF16 GGUF, -np 64 -t 2)",
                      [args.llama_server, "-m", args.llama_gguf, "-t", "2", "-np", "64",
                       "-c", "16384", "--port", "{port}"],
                      {"LD_LIBRARY_PATH": str(Path(args.llama_server).parent)}))
    else:
        print(f"llama-server skipped: no binary at {args.llama_server!r} or no BF16 GGUF at "
              f"{args.llama_gguf!r} (build it as in ../shared/anchors/README.md)")
    if args.vllm_python and Path(args.vllm_python).is_file() and Path(args.hf_model).is_dir():
        peers.append(("vllm serve (defaults: bfloat16)",
                      [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                       args.hf_model, "--port", "{port}",
                       # vLLM's CPU backend reserves this share of the NUMA node's memory at
                       # start and refuses to start when page cache (the model files) keeps
                       # less free; half is far more KV cache than 64 requests need
                       "--gpu-memory-utilization", "0.5"], {}))
    else:
        print(f"vllm serve skipped: no venv python at {args.vllm_python!r} or no model folder "
              f"at {args.hf_model!r}")
    for name, cmd, extra_env in peers:
        peer = External(cmd, extra_env, logs / "peer.log")
        try:
            results[name] = measure(peer.port, peer.model(), args.num_prompts)
        finally:
            peer.stop()
        print(row(name, results[name]), flush=True)

    print("\n| server | rate inf, cold: tok/s, p99 TTFT | rate inf, warm: tok/s | "
          "2 req/s: p99 TTFT / median TPOT | load average (1, 5, 15 min) |")
    print("|---|---|---|---|---|")
    for name, m in results.items():
        print(row(name, m))
    defaults = next(iter(results.values()))
    dtype = next(iter(results)).split(": ")[-1]
    off = offline(["--dtype", dtype] if dtype in ("float32", "bfloat16") else [],
                  args.num_prompts)
    print(f"\noffline engine ({dtype}, {args.num_prompts} random prompts 128 in / 64 out, greedy): "
          f"{off:.0f} tok/s; served at rate inf, cold: {defaults['cold_tok_s']:.0f} tok/s = "
          f"{defaults['cold_tok_s'] / off:.2f}x offline (load {load()})")
    print("\nAgainst the issue's recorded figures (ANOTHER SESSION, quiet machine, vLLM's client; "
          "ratios only meaningful on a quiet machine):")
    for peer, (tok_s, ttft, warm, r2_ttft, r2_tpot) in RECORDED.items():
        print(f"  defaults vs {peer}: cold {defaults['cold_tok_s'] / tok_s:.2f}x tok/s "
              f"(p99 TTFT {defaults['cold_p99_ttft']:,.0f} vs {ttft:,} ms), warm "
              f"{defaults['warm_tok_s'] / warm:.2f}x, 2 req/s p99 TTFT "
              f"{defaults['r2_p99_ttft']:.0f} vs {r2_ttft} ms, median TPOT "
              f"{defaults['r2_median_tpot']:.1f} vs {r2_tpot} ms")


if __name__ == "__main__":
    main()
