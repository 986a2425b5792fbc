"""`llmtower bench serve`: an online serving benchmark in the manner of `vllm bench serve`.

Sends streamed requests to an OpenAI-compatible server at a chosen arrival rate (Poisson, or
gamma with --burstiness) and concurrency, and reports throughput, TTFT, TPOT, ITL, end-to-end
latency and goodput. It reads only standard OpenAI fields, so it measures any such server.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from llmtower.bench.serve_client import RequestResult, build_payload, send_request
from llmtower.bench.serve_dataset import BenchRequest, load_jsonl_requests, sample_random_requests
from llmtower.bench.serve_metrics import compute_metrics, format_report, parse_goodput


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None,
                   help="server address (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1", help="server host (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="server port (default: 8000)")
    p.add_argument("--backend", choices=sorted(BACKENDS), default="openai",
                   help="request format, as vLLM names it: 'openai' (completions, prompt "
                   "text) or 'openai-chat' (chat messages) (default: openai)")
    p.add_argument("--endpoint", default=None, metavar="PATH",
                   help="path to POST to (default: /v1/completions for openai, "
                   "/v1/chat/completions for openai-chat)")
    p.add_argument("--model", default=None,
                   help="model name to send (default: the first of the server's /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for random prompts and token counts: a local model directory, "
                   "a .gguf file or 'smollm2-135m-instruct' (default: --model, if it is one)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer <key>'")
    p.add_argument("--dataset-name", choices=["random", "jsonl"], default="random",
                   help="random token prompts, or the JSONL file of --dataset-path "
                   "(default: random)")
    p.add_argument("--dataset-path", default=None,
                   help='JSONL file, one {"prompt": "...", "output_len": N} per line')
    p.add_argument("--random-input-len", type=int, default=1024,
                   help="prompt tokens of random prompts (default: 1024)")
    p.add_argument("--random-output-len", type=int, default=128,
                   help="tokens to generate per random prompt (default: 128)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default: 0)")
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="random tokens shared by every prompt, before its own (default: 0)")
    p.add_argument("--num-prompts", type=int, default=100,
                   help="requests to send (default: 100)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean arrivals per second; inf sends everything at once (default: inf)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times: 1 is Poisson, lower is "
                   "burstier (default: 1)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no limit)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default: 0)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature sent with each request (default: 0, greedy)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to ignore EOS so every request makes its full length "
                   "(an extension understood by vLLM-like servers)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys: ttft, tpot, e2el)")
    p.add_argument("--save-result", action="store_true", help="write the figures as JSON")
    p.add_argument("--result-dir", default=".", help="folder for --save-result (default: .)")
    p.add_argument("--result-filename", default=None,
                   help="file name for --save-result (default: a dated name)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


# --backend -> the request format; "vllm" is vLLM's alias of "openai".
BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}
DEFAULT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def resolve_target(args: argparse.Namespace) -> tuple[str, str, str]:
    """(base URL, request format "completions" | "chat", URL to POST to) from --base-url /
    --host / --port, --backend and --endpoint. The earlier ``--endpoint completions|chat``
    still means a format."""
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    kind = BACKENDS[args.backend]
    path = args.endpoint
    if path in DEFAULT_PATHS:  # the old spelling: a format, not a path
        kind, path = path, None
    path = path or DEFAULT_PATHS[kind]
    if not path.startswith("/"):
        raise ValueError(f"--endpoint {path!r} must be a path such as /v1/completions")
    return base, kind, base + path


def run(args: argparse.Namespace) -> int:
    import aiohttp

    try:
        return asyncio.run(_run(args))
    except ValueError as e:
        print(f"llmtower bench serve: error: {e}", file=sys.stderr)
        return 2
    except (aiohttp.ClientConnectionError, ConnectionError) as e:
        base, _, _ = resolve_target(args)
        print(f"llmtower bench serve: error: cannot reach a server at {base} ({e.__class__.__name__}"
              f"); start one with `llmtower serve`, or pass --base-url / --host / --port",
              file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace) -> int:
    import aiohttp

    if args.request_rate <= 0 or args.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    slos = parse_goodput(args.goodput)
    base, kind, url = resolve_target(args)
    args.endpoint, args.base_url = kind, base  # what the request builder and result file read
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model or await _first_model(session, base, headers)
        tokenizer = _load_tokenizer(args.tokenizer or model, required=args.dataset_name == "random"
                                    and not args.dataset_path)
        requests = _make_requests(args, tokenizer)

        def payload(r: BenchRequest) -> dict[str, Any]:
            return build_payload(args.endpoint, model, r, args.ignore_eos, args.temperature)

        print(f"checking the server with one request to {url} ...", file=sys.stderr)
        probe = await send_request(session, url, payload(BenchRequest(
            requests[0].prompt, requests[0].prompt_len, min(8, requests[0].output_len))),
            requests[0], args.endpoint, headers)
        if not probe.success:
            print(f"llmtower bench serve: the test request failed: {probe.error}",
                  file=sys.stderr)
            return 1
        results, duration = await _benchmark(session, url, requests, payload, args, headers)
    metrics = compute_metrics(results, duration, tokenizer, slos)
    print(format_report(metrics, args.max_concurrency, args.request_rate))
    if args.save_result:
        _save(args, model, metrics.to_dict())
    return 0 if metrics.completed else 1


async def _benchmark(session, url: str, requests: list[BenchRequest], payload, args,
                     headers) -> tuple[list[RequestResult], float]:
    rng = np.random.default_rng(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    pbar = None
    if not args.disable_tqdm:
        from tqdm.auto import tqdm
        pbar = tqdm(total=len(requests), desc="requests", file=sys.stderr)

    async def one(r: BenchRequest) -> RequestResult:
        if limit is None:
            res = await send_request(session, url, payload(r), r, args.endpoint, headers)
        else:
            async with limit:
                res = await send_request(session, url, payload(r), r, args.endpoint, headers)
        if pbar is not None:
            pbar.update(1)
        return res

    start = time.perf_counter()
    tasks = []
    for i, r in enumerate(requests):
        if i and args.request_rate != float("inf"):
            # Gamma inter-arrival times with mean 1/rate; shape 1 is a Poisson process.
            theta = 1.0 / (args.request_rate * args.burstiness)
            await asyncio.sleep(float(rng.gamma(shape=args.burstiness, scale=theta)))
        tasks.append(asyncio.create_task(one(r)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    return list(results), duration


async def _first_model(session, base: str, headers) -> str:
    async with session.get(f"{base}/v1/models", headers=headers) as resp:
        if resp.status != 200:
            raise ValueError(f"GET {base}/v1/models answered HTTP {resp.status}: pass --model")
        data = await resp.json()
    models = [m.get("id") for m in data.get("data", [])]
    if not models:
        raise ValueError(f"{base}/v1/models lists no model: pass --model")
    return models[0]


def _load_tokenizer(name: str, required: bool) -> Any | None:
    try:
        from llmtower.models.loader import load_tokenizer, resolve_model_path
        path = Path(name).expanduser()
        # A tokenizer-only directory is enough; anything else is resolved like --model.
        return load_tokenizer(path if path.is_dir() else resolve_model_path(name))
    except (OSError, ValueError) as e:
        if required:
            raise ValueError(f"random prompts need a tokenizer and {name!r} is not a local "
                             f"model ({e}); pass --tokenizer with a model directory") from None
        return None


def _make_requests(args, tokenizer) -> list[BenchRequest]:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.dataset_path or args.dataset_name == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path FILE")
        return load_jsonl_requests(args.dataset_path, args.num_prompts, args.random_output_len,
                                   tokenizer)
    return sample_random_requests(tokenizer, args.num_prompts, args.random_input_len,
                                  args.random_output_len, args.random_range_ratio,
                                  args.random_prefix_len, args.seed)


def _save(args, model: str, figures: dict[str, Any]) -> None:
    name = args.result_filename or (
        f"bench-serve-{args.endpoint}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    path = Path(args.result_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: getattr(args, k) for k in (
        "base_url", "backend", "endpoint", "dataset_name", "dataset_path", "random_input_len",
        "random_output_len", "random_range_ratio", "random_prefix_len", "num_prompts",
        "burstiness", "max_concurrency", "seed", "temperature", "ignore_eos", "goodput")}
    config["request_rate"] = "inf" if args.request_rate == float("inf") else args.request_rate
    config["model"] = model
    path.write_text(json.dumps({"date": datetime.now().isoformat(timespec="seconds"),
                                "config": config, **figures}, indent=2))
    print(f"results written to {path}", file=sys.stderr)
