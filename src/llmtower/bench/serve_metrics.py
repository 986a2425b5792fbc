"""Aggregate figures of one `llmtower bench serve` run, printed like `vllm bench serve`."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from llmtower.bench.serve_client import RequestResult

GOODPUT_KEYS = {"ttft", "tpot", "e2el"}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput {item!r} is invalid: use KEY:MS with KEY one of "
                             f"{', '.join(sorted(GOODPUT_KEYS))}, e.g. ttft:500 tpot:50")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
        if slos[key] <= 0:
            raise ValueError(f"--goodput {item!r}: the limit must be > 0 ms")
    return slos


def _stats(values_s: list[float]) -> dict[str, float]:
    a = np.asarray(values_s, dtype=float) * 1e3 if values_s else np.zeros(1)
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


@dataclass
class BenchmarkMetrics:
    """Throughput and latency distributions of a run (latencies in milliseconds)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def output_len(r: RequestResult, tokenizer: Any | None) -> int:
    """Generated tokens: the server's usage, else the tokenizer's count, else chunks."""
    if r.output_tokens:
        return r.output_tokens
    if tokenizer is not None and r.generated_text:
        return len(tokenizer.encode(r.generated_text, add_special_tokens=False))
    return r.num_chunks


def compute_metrics(results: list[RequestResult], duration_s: float, tokenizer: Any | None,
                    goodput_slos: dict[str, float]) -> BenchmarkMetrics:
    ok = [r for r in results if r.success]
    ttfts, tpots, itls, e2els = [], [], [], []
    good = 0
    total_in = total_out = 0
    for r in ok:
        n_out = output_len(r, tokenizer)
        total_in += r.prompt_len
        total_out += n_out
        tpot = (r.latency - r.ttft) / (n_out - 1) if n_out > 1 else 0.0
        ttfts.append(r.ttft)
        tpots.append(tpot)
        itls.extend(r.itl)
        e2els.append(r.latency)
        measured = {"ttft": r.ttft * 1e3, "tpot": tpot * 1e3, "e2el": r.latency * 1e3}
        if all(measured[k] <= limit for k, limit in goodput_slos.items()):
            good += 1
    duration_s = max(duration_s, 1e-9)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s, output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        request_goodput=good / duration_s if goodput_slos else None,
        ttft_ms=_stats(ttfts), tpot_ms=_stats(tpots), itl_ms=_stats(itls), e2el_ms=_stats(e2els),
        errors=sorted({r.error for r in results if not r.success})[:10])


def format_report(m: BenchmarkMetrics, max_concurrency: int | None, request_rate: float) -> str:
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:{fmt}}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Request rate configured (req/s):", "inf" if request_rate == float("inf")
        else f"{request_rate:.2f}")
    if max_concurrency:
        row("Maximum request concurrency:", max_concurrency)
    row("Benchmark duration (s):", m.duration_s, ".2f")
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput, ".2f")
    row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    row("Total token throughput (tok/s):", m.total_token_throughput, ".2f")
    for title, key, stats in (("Time to First Token", "TTFT", m.ttft_ms),
                              ("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms),
                              ("Inter-token Latency", "ITL", m.itl_ms),
                              ("End-to-end Latency", "E2EL", m.e2el_ms)):
        lines.append("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        row(f"Mean {key} (ms):", stats["mean"], ".2f")
        row(f"Median {key} (ms):", stats["median"], ".2f")
        row(f"P99 {key} (ms):", stats["p99"], ".2f")
    lines.append("=" * w)
    if m.errors:
        lines.append("errors (first distinct ones):")
        lines.extend(f"  {e}" for e in m.errors)
    return "\n".join(lines)
