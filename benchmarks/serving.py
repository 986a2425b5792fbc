"""Serving benchmark: `llmtower serve` + `llmtower bench serve` on W1 and on the default model,
at a request rate of 2 req/s and at an infinite rate (all requests at once).

    .venv/bin/python benchmarks/serving.py                  # both models, both rates
    .venv/bin/python benchmarks/serving.py --models w1 --rates inf --num-prompts 32

W1 (the synthetic random-weight Llama of the throughput workload, bench/synthetic.py) has no
tokenizer, so the server gets a word-level one with exactly W1's 16384 tokens ("w0" .. "w16383"):
every token decodes to text and random prompts re-encode to the same ids. Figures go to stdout
and, per run, to JSON files under --result-dir.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

W1_VOCAB_SIZE = 16384


def w1_tokenizer_dir() -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    out = cache / "llmtower" / "synthetic" / "w1-wordlevel-tokenizer"
    if (out / "tokenizer.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(W1_VOCAB_SIZE)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llmtower.cli.main", "serve", "--port", str(port), *args]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
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
    stop_server(proc)
    raise RuntimeError("the server did not start in 600 s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["w1", "default"], choices=["w1", "default"])
    p.add_argument("--rates", nargs="+", default=["2", "inf"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=2, help="torch threads of each engine")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "c", "torch"])
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="the engine's token budget per step: lower bounds the inter-token "
                        "latency that a prefill chunk adds, at some throughput")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine processes behind the server (try 2 with --num-threads 1)")
    p.add_argument("--result-dir", default="results/serving")
    a = p.parse_args()
    result_dir = Path(a.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in a.models:
        if model == "w1":
            from llmtower.bench.synthetic import synthetic_model_dir
            serve_args = ["--model", str(synthetic_model_dir("w1")), "--tokenizer",
                          str(w1_tokenizer_dir()), "--served-model-name", "w1"]
            tokenizer = str(w1_tokenizer_dir())
        else:
            serve_args, tokenizer = [], "smollm2-135m-instruct"
        port = free_port()
        proc = start_server([*serve_args, "--num-threads", str(a.num_threads),
                             "--data-parallel-size", str(a.data_parallel_size),
                             "--attention-backend", a.attention_backend,
                             "--max-num-batched-tokens", str(a.max_num_batched_tokens)], port,
                            result_dir / f"server-{model}.log")
        try:
            for rate in a.rates:
                name = f"{model}-rate-{rate}.json"
                cmd = [sys.executable, "-m", "llmtower.cli.main", "bench", "serve",
                       "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", tokenizer,
                       "--num-prompts", str(a.num_prompts), "--random-input-len",
                       str(a.input_len), "--random-output-len", str(a.output_len),
                       "--ignore-eos", "--request-rate", rate, "--seed", "0",
                       "--disable-tqdm", "--save-result", "--result-dir", str(result_dir),
                       "--result-filename", name]
                print(f"\n### {model}, request rate {rate}", flush=True)
                subprocess.run(cmd, check=True)
                r = json.loads((result_dir / name).read_text())
                rows.append((model, rate, r))
        finally:
            stop_server(proc)
    print(f"\n{'model':8} {'rate':>5} {'ok':>4} {'req/s':>6} {'out tok/s':>9} "
          f"{'TTFT mean/p99 ms':>17} {'TPOT mean ms':>12} {'ITL p99 ms':>10} {'E2E mean s':>10}")
    for model, rate, r in rows:
        print(f"{model:8} {rate:>5} {r['completed']:>4} {r['request_throughput']:>6.2f} "
              f"{r['output_throughput']:>9.1f} "
              f"{r['ttft_ms']['mean']:>8.0f}/{r['ttft_ms']['p99']:<8.0f} "
              f"{r['tpot_ms']['mean']:>12.1f} {r['itl_ms']['p99']:>10.1f} "
              f"{r['e2el_ms']['mean'] / 1e3:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
