"""`llmtower monitor`: a live terminal view of a running server, drawn with rich.

Every ``--interval`` it reads the server's ``/metrics`` and shows, per data-parallel engine and
in total: waiting / running / swapped requests and the input queue (with a sparkline of the
queue depth), preemptions and swaps per second, KV usage and fragmentation, the prefix-cache
hit rate, step delay and step time p50/p99, batch utilisation, token throughput, TTFT and ITL
p50/p99 and admission rejections. ``--metric NAME`` (repeatable) shows only the named series
(the dotted names of ``llmtower.metrics.names``). ``--once`` prints one snapshot (two scrapes an
interval apart, so rates exist) and exits; ``--json`` prints one JSON line per interval.

A server that is down or restarting is shown as down and polled again every interval: the
monitor never exits because of it (except ``--once``, which then exits 1).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from llmtower.cli.admin_http import DEFAULT_URL
from llmtower.metrics.names import SEED_METRICS, SeedMetric, resolve
from llmtower.metrics.scrape import Scrape, interval_quantile, parse_metrics, rate

SPARK = "▁▂▃▄▅▆▇█"
HISTORY = 40  # samples kept for the sparklines
TOTAL = "total"


def parse_interval(text: str) -> float:
    """``1s``, ``500ms``, ``2m`` or a plain number of seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not an interval: use e.g. 1s, 500ms, 2")
    value = float(m.group(1)) * {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]
    if value < 0.05:
        raise argparse.ArgumentTypeError(f"interval {text!r} is too short: use 50ms or more")
    return value


def register(sub) -> None:
    p = sub.add_parser(
        "monitor", help="live terminal view of a running server's scheduler and KV cache",
        description="Live view of a running llmtower server, read from its /metrics: queues, "
        "preemptions, KV cache, step delay, throughput and latency, per engine and in total.")
    p.add_argument("--url", default=DEFAULT_URL, help=f"server address (default: {DEFAULT_URL})")
    p.add_argument("--api-key", default=None,
                   help="the server's --api-key (sent as a Bearer token; /metrics is public)")
    p.add_argument("--interval", type=parse_interval, default=1.0,
                   help="time between two polls: 1s, 500ms, 2 ... (default: 1s)")
    p.add_argument("--metric", action="append", default=[], metavar="NAME",
                   help="show only this metric (repeatable), by its dotted name, e.g. "
                   "scheduler.queue_depth, input_queue.size, scheduler.preempt_count; "
                   "--list-metrics shows them all")
    p.add_argument("--list-metrics", action="store_true",
                   help="print the dotted names and their Prometheus series, then exit")
    p.add_argument("--once", action="store_true",
                   help="print one snapshot (two polls an interval apart) and exit")
    p.add_argument("--json", action="store_true",
                   help="print one JSON line per interval instead of the live view")
    p.add_argument("--count", type=int, default=0,
                   help="stop after this many intervals (default: 0, run until Ctrl-C)")
    p.set_defaults(handler=run)


# ---------------------------------------------------------------------- polling
@dataclass
class Sample:
    """What one poll found: the server up with its values, or down with the reason."""

    time: float
    up: bool
    error: str | None = None
    engines: list[str] = field(default_factory=list)
    # view[engine or "total"][key] -> value; keys are dotted names, with .per_s / .p50 / .p99
    view: dict[str, dict[str, float | None]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"time": round(self.time, 3), "up": self.up, "error": self.error,
                "engines": {e: self.view.get(e, {}) for e in self.engines},
                "total": self.view.get(TOTAL, {})}


class Poller:
    """Owns the HTTP client, the previous scrape (for rates and interval quantiles) and the
    history behind the sparklines."""

    def __init__(self, url: str, api_key: str | None, metrics: list[SeedMetric],
                 timeout_s: float = 5.0) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.metrics = metrics
        self._client = httpx.Client(headers=headers, timeout=timeout_s)
        self._prev: Scrape | None = None
        self.history: dict[str, deque[float]] = {}

    def close(self) -> None:
        self._client.close()

    def poll(self) -> Sample:
        import httpx

        now = time.time()
        try:
            r = self._client.get(f"{self.url}/metrics")
            if r.status_code != 200:
                raise RuntimeError(f"/metrics answered HTTP {r.status_code}")
            cur = parse_metrics(r.text, now)
        except (httpx.HTTPError, RuntimeError, ValueError) as e:
            self._prev = None  # a restarted server's counters begin again
            return Sample(now, False, _reason(e))
        engines = cur.engines() or ["0"]
        view = {e: compute(self.metrics, self._prev, cur, e) for e in engines}
        view[TOTAL] = compute(self.metrics, self._prev, cur, None, engines)
        self._prev = cur
        for key in (*engines, TOTAL):
            depth = view[key].get("scheduler.queue_depth")
            if depth is not None:
                self.history.setdefault(key, deque(maxlen=HISTORY)).append(depth)
        return Sample(now, True, None, engines, view)


def _reason(e: Exception) -> str:
    text = str(e) or type(e).__name__
    if "Connection refused" in text or "connect" in type(e).__name__.lower():
        return f"connection refused ({type(e).__name__})"
    return text[:200]


def compute(metrics: list[SeedMetric], prev: Scrape | None, cur: Scrape, engine: str | None,
            engines: list[str] | None = None) -> dict[str, float | None]:
    """The values of ``metrics`` for one engine, or in total (``engine`` None)."""
    out: dict[str, float | None] = {}
    for m in metrics:
        if m.kind == "gauge":
            if engine is None and m.aggregate != "sum" and engines:
                per = [cur.total(m.prom, e, m.labels) for e in engines]
                per_v = [v for v in per if v is not None]
                if not per_v:
                    out[m.dotted] = cur.total(m.prom, None, m.labels)
                else:
                    out[m.dotted] = (max(per_v) if m.aggregate == "max"
                                     else sum(per_v) / len(per_v))
            else:
                out[m.dotted] = cur.total(m.prom, engine, m.labels)
        elif m.kind == "counter":
            out[m.dotted] = cur.total(m.prom, engine, m.labels)
            out[f"{m.dotted}.per_s"] = rate(prev, cur, m.prom, engine, m.labels)
        elif m.kind == "histogram":
            out[f"{m.dotted}.p50"] = interval_quantile(prev, cur, m.prom, 0.5, engine)
            out[f"{m.dotted}.p99"] = interval_quantile(prev, cur, m.prom, 0.99, engine)
        elif m.kind == "ratio":
            assert m.denominator is not None
            num = rate(prev, cur, m.prom, engine)
            den = rate(prev, cur, m.denominator, engine)
            if not den or num is None:  # no lookups in the interval: since the start
                num, den = cur.total(m.prom, engine), cur.total(m.denominator, engine)
            out[m.dotted] = num / den if num is not None and den else None
    return out


# ---------------------------------------------------------------------- rendering
def sparkline(values: deque[float] | list[float]) -> str:
    if not values:
        return ""
    top = max(max(values), 1.0)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))]
                   for v in values)


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value * 1e3:.1f}"
    if unit == "%":
        return f"{value * 100:.1f}%"
    if unit == "/s":
        return f"{value:.1f}"
    return f"{value:g}" if value != int(value) else str(int(value))


# The default view: (heading, [(column title, key, unit, SeedMetric for the health colour)]).
def _col(title: str, key: str, unit: str = "") -> tuple[str, str, str]:
    return title, key, unit


SECTIONS: list[tuple[str, list[tuple[str, str, str]]]] = [
    ("requests", [_col("running", "scheduler.running"), _col("waiting", "scheduler.queue_depth"),
                  _col("swapped", "scheduler.swapped"), _col("input queue", "input_queue.size"),
                  _col("preempt/s", "scheduler.preempt_count.per_s", "/s"),
                  _col("swap out/s", "scheduler.swap_outs.per_s", "/s"),
                  _col("swap in/s", "scheduler.swap_ins.per_s", "/s"),
                  _col("rejected/s", "requests.rejected.per_s", "/s")]),
    ("KV cache", [_col("usage", "kv_cache.usage", "%"),
                  _col("free blocks", "kv_cache.free_blocks"),
                  _col("frag int", "kv_cache.fragmentation_ratio", "%"),
                  _col("frag ext", "kv_cache.external_fragmentation", "%"),
                  _col("prefix hit", "prefix_cache.hit_rate", "%"),
                  _col("evict/s", "kv_cache.evictions.per_s", "/s")]),
    ("steps (ms)", [_col("delay p50", "scheduler.step_delay.p50", "ms"),
                    _col("delay p99", "scheduler.step_delay.p99", "ms"),
                    _col("step p50", "scheduler.step_time.p50", "ms"),
                    _col("step p99", "scheduler.step_time.p99", "ms"),
                    _col("batch util", "batch.utilization", "%")]),
    ("throughput and latency", [
        _col("prompt tok/s", "throughput.prompt_tokens.per_s", "/s"),
        _col("gen tok/s", "throughput.generation_tokens.per_s", "/s"),
        _col("TTFT p50 ms", "requests.ttft.p50", "ms"),
        _col("TTFT p99 ms", "requests.ttft.p99", "ms"),
        _col("ITL p50 ms", "requests.itl.p50", "ms"),
        _col("ITL p99 ms", "requests.itl.p99", "ms"),
        _col("queue p99 ms", "requests.queue_time_p99", "ms")]),
]


def _metric_of(key: str) -> SeedMetric | None:
    base = key.rsplit(".", 1)[0] if key.endswith((".per_s", ".p50", ".p99")) else key
    try:
        return resolve(base)
    except ValueError:
        return None


def _cell(sample: Sample, row: str, key: str, unit: str) -> Text:
    value = sample.view.get(row, {}).get(key)
    m = _metric_of(key)
    # Histograms are judged by their p99 (the design's alert thresholds are tails).
    judged = m is not None and (not key.endswith(".p50"))
    bad = judged and m is not None and not m.healthy(value)
    return Text(fmt(value, unit), style="bold red" if bad else "")


def _rows(sample: Sample) -> list[str]:
    return sample.engines + [TOTAL] if len(sample.engines) > 1 else [TOTAL]


def render(sample: Sample, poller: Poller, url: str, selected: list[SeedMetric] | None) -> Group:
    stamp = time.strftime("%H:%M:%S", time.localtime(sample.time))
    if not sample.up:
        return Group(Text(f"llmtower monitor  {url}  {stamp}  ", style="bold"),
                     Text(f"server DOWN: {sample.error}; retrying every interval",
                          style="bold red"))
    head = Text(f"llmtower monitor  {url}  {stamp}  up, {len(sample.engines)} engine(s)",
                style="bold")
    parts: list[Any] = [head]
    rows = _rows(sample)
    if selected:
        t = Table("metric", *[f"engine {r}" if r != TOTAL else TOTAL for r in rows],
                  "history (total)", box=None, header_style="bold")
        for m in selected:
            for key, unit in _keys_of(m):
                t.add_row(key, *[_cell(sample, r, key, unit) for r in rows],
                          sparkline(poller.history.get(TOTAL, []))
                          if m.dotted == "scheduler.queue_depth" else "")
        parts.append(t)
        return Group(*parts)
    for heading, cols in SECTIONS:
        t = Table("engine", *[c[0] for c in cols], box=None, header_style="bold",
                  title=heading, title_justify="left", title_style="bold cyan")
        if heading == "requests":
            t.add_column("queue depth")
        for r in rows:
            cells = [_cell(sample, r, key, unit) for _, key, unit in cols]
            if heading == "requests":
                cells.append(Text(sparkline(poller.history.get(r, [])), style="cyan"))
            t.add_row(r, *cells)
        parts.append(t)
    return Group(*parts)


def _keys_of(m: SeedMetric) -> list[tuple[str, str]]:
    seconds = m.dotted.startswith(("scheduler.step", "requests.ttft", "requests.itl",
                                   "requests.queue_time"))
    if m.kind == "counter":
        return [(m.dotted, ""), (f"{m.dotted}.per_s", "/s")]
    if m.kind == "histogram":
        return [(f"{m.dotted}.p50", "ms"), (f"{m.dotted}.p99", "ms")]
    if m.kind == "ratio" or m.dotted in ("kv_cache.usage", "batch.utilization") or \
            "fragmentation" in m.dotted:
        return [(m.dotted, "%")]
    return [(m.dotted, "ms" if seconds else "")]


def _needed(selected: list[SeedMetric] | None) -> list[SeedMetric]:
    return selected if selected else list(SEED_METRICS)


# ---------------------------------------------------------------------- the command
def run(args: argparse.Namespace) -> int:
    if args.list_metrics:
        for m in SEED_METRICS:
            labels = "{" + ",".join(f'{k}="{v}"' for k, v in m.labels.items()) + "}" \
                if m.labels else ""
            print(f"{m.dotted:34s} {m.kind:9s} {m.prom}{labels}  ({m.doc})")
        return 0
    try:
        selected = [resolve(n) for n in args.metric] or None
    except ValueError as e:
        print(f"llmtower monitor: error: {e}", file=sys.stderr)
        return 2
    poller = Poller(args.url, args.api_key, _needed(selected),
                    timeout_s=min(5.0, max(1.0, args.interval)))
    console = Console(highlight=False)
    try:
        if args.once:
            return _run_once(args, poller, console, selected)
        if args.json:
            return _run_json(args, poller)
        return _run_live(args, poller, console, selected)
    except KeyboardInterrupt:
        return 0
    finally:
        poller.close()


def _sleep_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()))


def _run_once(args, poller: Poller, console: Console, selected) -> int:
    poller.poll()
    time.sleep(args.interval)
    sample = poller.poll()
    if args.json:
        print(json.dumps(sample.to_json()), flush=True)
    else:
        console.print(render(sample, poller, args.url, selected))
    return 0 if sample.up else 1


def _run_json(args, poller: Poller) -> int:
    n = 0
    deadline = time.monotonic()
    while not args.count or n < args.count:
        sample = poller.poll()
        print(json.dumps(sample.to_json()), flush=True)
        n += 1
        deadline += args.interval
        _sleep_until(deadline)
    return 0


def _run_live(args, poller: Poller, console: Console, selected) -> int:
    from rich.live import Live

    n = 0
    deadline = time.monotonic()
    sample = poller.poll()
    with Live(render(sample, poller, args.url, selected), console=console,
              refresh_per_second=4, transient=False) as live:
        while True:
            n += 1
            if args.count and n >= args.count:
                break
            deadline += args.interval
            _sleep_until(deadline)
            sample = poller.poll()
            live.update(render(sample, poller, args.url, selected))
    return 0
