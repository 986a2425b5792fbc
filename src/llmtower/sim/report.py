"""Turn a run's raw statistics into the result a user reads: the ``vllm bench serve`` summary,
the scheduler's counters, per-priority / per-tenant / per-replica breakdowns, and tables."""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmtower.sim.metrics import (class_summary, latency_stats, meets_slo, tpot_seconds,
                                  weighted_latency_stats)
from llmtower.sim.simulator import RunStats

TIMELINE_POINTS = 1000


@dataclass
class SimResult:
    """Owns everything one simulation produced, in JSON-ready form, plus the per-request
    columns and timelines the plots need."""

    config: dict[str, Any]
    summary: dict[str, Any]
    by_priority: dict[str, Any]
    by_tenant: dict[str, Any]
    by_replica: list[dict[str, Any]]
    requests: dict[str, np.ndarray]
    timeline: dict[str, np.ndarray]

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "summary": self.summary, "by_priority": self.by_priority,
                "by_tenant": self.by_tenant, "by_replica": self.by_replica,
                "requests": {k: v.tolist() for k, v in self.requests.items()},
                "timeline": {k: v.tolist() for k, v in self.timeline.items()}}


def build_result(stats: RunStats) -> SimResult:
    m = stats.metrics
    log = m.log
    trace = stats.trace
    # Rows in trace order: the same for any event order among replicas (a sharded run's shards
    # finish in their own order), so sums and means come out bit for bit the same.
    order = np.argsort(np.asarray(log.index, dtype=np.int64), kind="stable")
    idx = np.asarray(log.index, dtype=np.int64)[order]
    cols = {
        "index": idx,
        "replica": np.asarray(log.replica, dtype=np.int64)[order],
        "ttft": np.asarray(log.ttft, dtype=np.float64)[order],
        "e2e": np.asarray(log.e2e, dtype=np.float64)[order],
        "finish": np.asarray(log.finish, dtype=np.float64)[order],
        "prompt_tokens": np.asarray(log.prompt_tokens, dtype=np.int64)[order],
        "output_tokens": np.asarray(log.output_tokens, dtype=np.int64)[order],
        "cached_tokens": np.asarray(log.cached_tokens, dtype=np.int64)[order],
        "preemptions": np.asarray(log.preemptions, dtype=np.int64)[order],
        "priority": np.asarray([trace[i].priority for i in idx], dtype=np.int64),
        "arrival": np.asarray([trace[i].arrival_time for i in idx], dtype=np.float64),
    }
    tenants = [trace[i].tenant for i in idx]
    first = min((r.arrival_time for r in trace), default=0.0)
    duration = float(cols["finish"].max() - first) if len(idx) else 0.0
    slo = stats.config.slo
    completed = len(idx)
    out_tok = int(cols["output_tokens"].sum())
    in_tok = int(cols["prompt_tokens"].sum())
    itl = sorted(m.itl_counts.items())  # by value: independent of the order of events
    itl_v = np.fromiter((g for g, _ in itl), dtype=np.float64, count=len(itl))
    itl_c = np.fromiter((c for _, c in itl), dtype=np.int64, count=len(itl))
    reps = stats.replicas
    queries = sum(r.prefix_cache_queries for r in reps)
    hits = sum(r.prefix_cache_hits for r in reps)
    summary: dict[str, Any] = {
        "completed": completed,
        "rejected": len(m.rejected),
        "unfinished": m.num_unfinished,
        "duration_s": duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": completed / duration if duration > 0 else 0.0,
        "output_throughput": out_tok / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else 0.0,
        "ttft_ms": latency_stats(cols["ttft"]),
        "tpot_ms": latency_stats(tpot_seconds(cols["ttft"], cols["e2e"], cols["output_tokens"])),
        "itl_ms": weighted_latency_stats(itl_v, itl_c),
        "e2el_ms": latency_stats(cols["e2e"]),
        "num_preemptions": sum(r.num_preemptions for r in reps),
        "num_swap_outs": sum(r.num_swap_outs for r in reps),
        "num_swap_ins": sum(r.num_swap_ins for r in reps),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "peak_kv_usage": max(r.peak_kv_usage for r in stats.replicas),
        "num_steps": sum(r.num_steps for r in stats.replicas),
        "wall_s": stats.wall_s,
        "sim_requests_per_wall_s": len(trace) / stats.wall_s if stats.wall_s > 0 else 0.0,
    }
    if slo.active:
        good = int(meets_slo(slo, cols["ttft"], cols["e2e"], cols["output_tokens"]).sum())
        summary["goodput_req_s"] = good / duration if duration > 0 else 0.0
        summary["slo_attainment"] = good / completed if completed else 0.0
    by_priority = {str(p): class_summary(cols["priority"] == p, cols, duration, slo)
                   for p in sorted(set(cols["priority"].tolist()))}
    tenant_arr = np.asarray(tenants, dtype=object)
    by_tenant = {t: class_summary(tenant_arr == t, cols, duration, slo)
                 for t in sorted(set(tenants))}
    by_replica = [{
        "replica": r.index,
        "completed": int((cols["replica"] == r.index).sum()),
        "busy_s": r.busy_s,
        "num_steps": r.num_steps,
        "num_preemptions": r.num_preemptions,
        "peak_kv_usage": r.peak_kv_usage,
    } for r in stats.replicas]
    config = {
        "device": stats.device.name, "model": stats.model.name,
        "tensor_parallel_size": stats.config.tensor_parallel_size,
        "num_replicas": stats.config.num_replicas, "load_balancer": stats.config.load_balancer,
        "num_blocks_per_replica": stats.num_blocks,
        "num_cpu_blocks_per_replica": stats.num_cpu_blocks,
        "max_model_len": stats.max_model_len, "num_requests": len(trace),
        "engine": {k: v for k, v in asdict(stats.config.engine).items()
                   if k not in ("model", "tokenizer", "served_model_name")},
        "slo": asdict(slo),
    }
    return SimResult(config, summary, by_priority, by_tenant, by_replica,
                     {k: v for k, v in cols.items()}, _timeline(stats))


def _timeline(stats: RunStats) -> dict[str, np.ndarray]:
    """Cluster-wide state sampled on a regular grid: total waiting / running / swapped
    requests, mean KV usage (each replica holds its last value between its steps)."""
    tls = [tl for tl in stats.metrics.timelines if len(tl.t)]
    if not tls:
        return {k: np.zeros(0) for k in ("t", "waiting", "running", "swapped", "kv_usage")}
    end = max(tl.t[-1] for tl in tls)
    start = min(tl.t[0] for tl in tls)
    grid = np.linspace(start, end, TIMELINE_POINTS)
    out = {"t": grid, "waiting": np.zeros(len(grid)), "running": np.zeros(len(grid)),
           "swapped": np.zeros(len(grid)), "kv_usage": np.zeros(len(grid))}
    for tl in stats.metrics.timelines:
        if not len(tl.t):
            continue
        t = np.frombuffer(tl.t, dtype=np.float64)
        pos = np.searchsorted(t, grid, side="right") - 1
        valid = pos >= 0
        for key in ("waiting", "running", "swapped", "kv_usage"):
            vals = np.asarray(getattr(tl, key), dtype=np.float64)
            out[key][valid] += vals[pos[valid]]
    out["kv_usage"] /= len(stats.metrics.timelines)
    return out


# ---------------------------------------------------------------------- text
def _row(label: str, value: Any, fmt: str = "{:.2f}") -> str:
    text = value if isinstance(value, str) else fmt.format(value)
    return f"{label:<40}{text:>12}"


def format_result(res: SimResult, title: str = "Simulation Result") -> str:
    s = res.summary
    lines = [f"{' ' + title + ' ':=^52}",
             _row("Successful requests:", s["completed"], "{}"),
             _row("Rejected requests:", s["rejected"], "{}"),
             _row("Simulated duration (s):", s["duration_s"]),
             _row("Total input tokens:", s["total_input_tokens"], "{}"),
             _row("Total generated tokens:", s["total_output_tokens"], "{}"),
             _row("Request throughput (req/s):", s["request_throughput"]),
             _row("Output token throughput (tok/s):", s["output_throughput"]),
             _row("Total Token throughput (tok/s):", s["total_token_throughput"])]
    if "goodput_req_s" in s:
        lines.append(_row("Request goodput (req/s):", s["goodput_req_s"]))
        lines.append(_row("SLO attainment (%):", 100 * s["slo_attainment"]))
    for key, name, head in (("ttft_ms", "TTFT", "Time to First Token"),
                            ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
                            ("itl_ms", "ITL", "Inter-token Latency"),
                            ("e2el_ms", "E2EL", "End-to-end Latency")):
        lines.append(f"{head:-^52}")
        for stat in ("mean", "median", "p99"):
            lines.append(_row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {name} (ms):",
                              s[key][stat]))
    lines.append(f"{'Scheduler':-^52}")
    lines += [_row("Preemptions:", s["num_preemptions"], "{}"),
              _row("Swap-outs / swap-ins:", f"{s['num_swap_outs']} / {s['num_swap_ins']}"),
              _row("Prefix cache hit rate (%):", 100 * s["prefix_cache_hit_rate"]),
              _row("Peak KV cache usage (%):", 100 * s["peak_kv_usage"]),
              _row("Engine steps:", s["num_steps"], "{}")]
    for title_, groups in (("By priority", res.by_priority), ("By tenant", res.by_tenant)):
        if len(groups) > 1:
            lines.append(f"{title_:-^52}")
            lines.append(_class_table(groups))
    lines.append("=" * 52)
    lines.append(f"simulated {res.config['num_requests']} requests in {s['wall_s']:.2f} s wall "
                 f"({s['sim_requests_per_wall_s']:.0f} req/s)")
    return "\n".join(lines)


def _class_table(groups: dict[str, Any]) -> str:
    head = f"{'class':<10}{'n':>7}{'TTFT mean':>11}{'TTFT p99':>10}{'TPOT mean':>11}{'E2E p99':>10}"
    rows = [head]
    for name, g in groups.items():
        rows.append(f"{name:<10}{g['completed']:>7}{g['ttft_ms']['mean']:>11.1f}"
                    f"{g['ttft_ms']['p99']:>10.1f}{g['tpot_ms']['mean']:>11.2f}"
                    f"{g['e2el_ms']['p99']:>10.1f}")
    return "\n".join(rows)


def format_compare_table(field_name: str, results: list[tuple[str, SimResult]]) -> str:
    """One row per variant: throughput, latencies, goodput and the scheduler's counters; plus
    the p99 TTFT of each priority class when the trace has several."""
    prios = sorted({p for _, r in results for p in r.by_priority}, key=int)
    tenants = sorted({t for _, r in results for t in r.by_tenant})
    width = max(14, len(field_name) + 2, *(len(v) + 2 for v, _ in results))
    cols = [(field_name, width), ("req/s", 9), ("out tok/s", 10), ("TTFT mean", 10),
            ("TTFT p99", 10), ("TPOT mean", 10), ("TPOT p99", 9), ("E2E p99", 10)]
    if any("goodput_req_s" in r.summary for _, r in results):
        cols.append(("goodput", 9))
    cols += [("preempt", 8), ("swaps", 7), ("hit %", 7), ("peak KV%", 9)]
    if len(prios) > 1:
        cols += [(f"p{p} TTFT p99", 13) for p in prios]
    if len(tenants) > 1:
        cols += [(f"{t} TTFT p99", max(13, len(t) + 11)) for t in tenants]
    lines = ["".join(f"{c:>{w}}" for c, w in cols)]
    for value, r in results:
        s = r.summary
        cells = [value, f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.0f}",
                 f"{s['ttft_ms']['mean']:.1f}", f"{s['ttft_ms']['p99']:.1f}",
                 f"{s['tpot_ms']['mean']:.2f}", f"{s['tpot_ms']['p99']:.2f}",
                 f"{s['e2el_ms']['p99']:.0f}"]
        if any("goodput_req_s" in x.summary for _, x in results):
            cells.append(f"{s.get('goodput_req_s', float('nan')):.2f}")
        cells += [str(s["num_preemptions"]), str(s["num_swap_outs"]),
                  f"{100 * s['prefix_cache_hit_rate']:.1f}", f"{100 * s['peak_kv_usage']:.1f}"]
        if len(prios) > 1:
            cells += [f"{r.by_priority[p]['ttft_ms']['p99']:.1f}" if p in r.by_priority else "-"
                      for p in prios]
        if len(tenants) > 1:
            cells += [f"{r.by_tenant[t]['ttft_ms']['p99']:.1f}" if t in r.by_tenant else "-"
                      for t in tenants]
        lines.append("".join(f"{c:>{w}}" for c, (_, w) in zip(cells, cols)))
    lines.append("(latencies in ms)")
    return "\n".join(lines)


def save_json(payload: Any, path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=1, default=_json_default, allow_nan=True) + "\n")
    return p


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return None if math.isnan(o) else float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"cannot serialize {type(o).__name__}")
