"""What a simulation measured: the metrics of ``vllm bench serve`` and the scheduler's own.

Definitions follow ``vllm bench serve``: TTFT = first token - arrival; TPOT = (E2E - TTFT) /
(output tokens - 1), for requests with more than one output token; ITL = every gap between
two consecutive tokens of a request; E2E = finish - arrival; duration = last finish - first
arrival; goodput = requests meeting every SLO / duration. Times are reported in ms.
"""
from __future__ import annotations

from array import array
from collections import Counter
from itertools import repeat
from operator import attrgetter
from dataclasses import dataclass, field

import numpy as np

from llmtower.core.outputs import EngineCoreOutput


_SLO_FIELDS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}


@dataclass
class SLO:
    """Owns latency objectives (ms); None means no objective on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: list[str] | None) -> SLO:
        """['ttft:200', 'tpot:50'] (the syntax of vllm bench serve's --goodput)."""
        slo = cls()
        for item in items or []:
            key, _, value = item.partition(":")
            name = _SLO_FIELDS.get(key.strip().lower())
            try:
                ms = float(value)
            except ValueError:
                ms = -1.0
            if name is None or ms <= 0:
                raise ValueError(f"cannot read SLO {item!r}: use ttft:MS, tpot:MS or e2el:MS with "
                                 "a positive number of milliseconds")
            setattr(slo, name, ms)
        return slo

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


@dataclass
class RequestLog:
    """Owns one row per finished request, as columns (trace index, latencies in s, tokens)."""

    index: array = field(default_factory=lambda: array("q"))
    replica: array = field(default_factory=lambda: array("q"))
    ttft: array = field(default_factory=lambda: array("d"))
    e2e: array = field(default_factory=lambda: array("d"))
    finish: array = field(default_factory=lambda: array("d"))
    prompt_tokens: array = field(default_factory=lambda: array("q"))
    output_tokens: array = field(default_factory=lambda: array("q"))
    cached_tokens: array = field(default_factory=lambda: array("q"))
    preemptions: array = field(default_factory=lambda: array("q"))


@dataclass
class Timeline:
    """Owns one replica's state after each of its steps."""

    t: array = field(default_factory=lambda: array("d"))
    waiting: array = field(default_factory=lambda: array("q"))
    running: array = field(default_factory=lambda: array("q"))
    swapped: array = field(default_factory=lambda: array("q"))
    kv_usage: array = field(default_factory=lambda: array("d"))


_request_id = attrgetter("request_id")


class MetricsCollector:
    """Owns what a simulation records while it runs: finished requests, every inter-token gap
    (as a value -> count map: within a step most requests share one gap), rejections and the
    per-replica timelines."""

    def __init__(self, num_replicas: int) -> None:
        self.log = RequestLog()
        self.timelines = [Timeline() for _ in range(num_replicas)]
        self.rejected: dict[str, str] = {}  # request id -> reason
        self.itl_counts: dict[float, int] = {}
        self._last_token: dict[str, float] = {}
        self._index: dict[str, int] = {}  # request id -> trace index
        self.first_arrival = float("inf")

    def on_submit(self, request_id: str, trace_index: int, arrival: float) -> None:
        self._index[request_id] = trace_index
        if arrival < self.first_arrival:
            self.first_arrival = arrival

    def on_rejected(self, request_id: str, reason: str) -> None:
        self._index.pop(request_id, None)
        self.rejected[request_id] = reason

    def on_outputs(self, outputs: list[EngineCoreOutput], now: float, replica: int) -> None:
        """Record one step's outputs (all stamped ``now``). The per-output work is C-level
        passes: within a step most requests share the time of their previous token, so the
        gaps are counted per distinct previous time."""
        if not outputs:
            return
        last = self._last_token
        rids = list(map(_request_id, outputs))
        gaps = self.itl_counts
        for prev, count in Counter(map(last.get, rids)).items():
            if prev is not None:
                g = now - prev
                gaps[g] = gaps.get(g, 0) + count
        last.update(zip(rids, repeat(now)))
        for o in outputs:
            if o.finish_reason is not None:
                self._finish(o, now, replica)

    def on_decode_steps(self, request_ids: list[str], ends: list[float],
                        alive: list[int] | None = None) -> None:
        """Record a run of plain decode steps (one token per request per step, step i ending
        at ``ends[i]``, ``alive[i]`` requests in step i: those that stop leave after their
        step; default: all of them every step): the gaps ``on_outputs`` would count step by
        step (the requests that stop are then passed to ``on_finished``)."""
        last = self._last_token
        gaps = self.itl_counts
        first = ends[0]
        prevs = list(map(last.get, request_ids))
        # Mostly one previous time (the last step's end), and None for the requests whose
        # first token this is (a run from the step that admitted them): counted in C passes.
        first_prev = prevs[0] if prevs else None
        same = prevs.count(first_prev)
        if same == len(prevs) or (first_prev is not None
                                  and same + prevs.count(None) == len(prevs)):
            counted = ((first_prev, same),)
        else:
            counted = Counter(prevs).items()  # type: ignore[assignment]
        for prev, count in counted:
            if prev is not None:
                g = first - prev
                gaps[g] = gaps.get(g, 0) + count
        n = len(request_ids)
        for i in range(1, len(ends)):
            g = ends[i] - ends[i - 1]
            gaps[g] = gaps.get(g, 0) + (n if alive is None else alive[i])
        last.update(zip(request_ids, repeat(ends[-1])))

    def on_finished(self, o: EngineCoreOutput, now: float, replica: int) -> None:
        """A request's last output (its gaps recorded already)."""
        self._finish(o, now, replica)

    def _finish(self, o: EngineCoreOutput, now: float, replica: int) -> None:
        rid = o.request_id
        del self._last_token[rid]
        m = o.metrics
        assert m is not None  # the scheduler attaches metrics to every finishing output
        log = self.log
        log.index.append(self._index.pop(rid))
        log.replica.append(replica)
        log.ttft.append(m.ttft)
        log.e2e.append(m.e2e_latency)
        log.finish.append(now)
        log.prompt_tokens.append(m.num_prompt_tokens)
        log.output_tokens.append(m.num_generation_tokens)
        log.cached_tokens.append(m.num_cached_tokens)
        log.preemptions.append(m.num_preemptions)

    def on_step(self, replica: int, now: float, waiting: int, running: int, swapped: int,
                kv_usage: float) -> None:
        tl = self.timelines[replica]
        tl.t.append(now)
        tl.waiting.append(waiting)
        tl.running.append(running)
        tl.swapped.append(swapped)
        tl.kv_usage.append(kv_usage)

    def on_steps(self, replica: int, starts: list[float], running: list[int],
                 kv_usage: list[float]) -> None:
        """``on_step`` for several steps of a decode run (nothing waiting or swapped)."""
        tl = self.timelines[replica]
        tl.t.extend(starts)
        tl.waiting.extend(repeat(0, len(starts)))
        tl.running.extend(running)
        tl.swapped.extend(repeat(0, len(starts)))
        tl.kv_usage.extend(kv_usage)

    @property
    def num_unfinished(self) -> int:
        return len(self._index)

    @classmethod
    def merge(cls, parts: list[MetricsCollector], num_replicas: int) -> MetricsCollector:
        """One collector from those of disjoint sets of replicas (a sharded run). Rows come
        in shard order; the report orders them by trace index, as it does for any run."""
        out = cls(num_replicas)
        for p in parts:
            for name in RequestLog.__dataclass_fields__:
                getattr(out.log, name).extend(getattr(p.log, name))
            for i, tl in enumerate(p.timelines):
                if len(tl.t):
                    out.timelines[i] = tl
            out.rejected.update(p.rejected)
            for g, c in p.itl_counts.items():
                out.itl_counts[g] = out.itl_counts.get(g, 0) + c
            out._last_token.update(p._last_token)
            out._index.update(p._index)
            out.first_arrival = min(out.first_arrival, p.first_arrival)
        return out


# ---------------------------------------------------------------------- summaries
def latency_stats(seconds: np.ndarray) -> dict[str, float]:
    """mean / median / p99 / std in ms (NaN for an empty set)."""
    if len(seconds) == 0:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan"),
                "std": float("nan")}
    ms = np.asarray(seconds) * 1000.0
    return {"mean": float(ms.mean()), "median": float(np.median(ms)),
            "p99": float(np.percentile(ms, 99)), "std": float(ms.std())}


def weighted_latency_stats(values_s: np.ndarray, counts: np.ndarray) -> dict[str, float]:
    """The same statistics over values that occur ``counts`` times each."""
    total = int(counts.sum()) if len(counts) else 0
    if total == 0:
        return latency_stats(np.zeros(0))
    order = np.argsort(values_s)
    v = np.asarray(values_s)[order] * 1000.0
    c = np.asarray(counts)[order]
    cum = np.cumsum(c)
    mean = float((v * c).sum() / total)

    def pct(q: float) -> float:
        return float(v[min(len(v) - 1, int(np.searchsorted(cum, q * total, side="left")))])

    return {"mean": mean, "median": pct(0.5), "p99": pct(0.99),
            "std": float(np.sqrt(max(0.0, (c * (v - mean) ** 2).sum() / total)))}


def tpot_seconds(ttft: np.ndarray, e2e: np.ndarray, out: np.ndarray) -> np.ndarray:
    """TPOT per request with more than one output token (others excluded, as vLLM does)."""
    m = out > 1
    return (e2e[m] - ttft[m]) / (out[m] - 1)


def meets_slo(slo: SLO, ttft: np.ndarray, e2e: np.ndarray, out: np.ndarray) -> np.ndarray:
    ok = np.ones(len(ttft), dtype=bool)
    if slo.ttft_ms is not None:
        ok &= ttft * 1000.0 <= slo.ttft_ms
    if slo.tpot_ms is not None:
        tpot = np.where(out > 1, (e2e - ttft) / np.maximum(out - 1, 1), 0.0)
        ok &= tpot * 1000.0 <= slo.tpot_ms
    if slo.e2el_ms is not None:
        ok &= e2e * 1000.0 <= slo.e2el_ms
    return ok


def class_summary(mask: np.ndarray, cols: dict[str, np.ndarray], duration: float,
                  slo: SLO) -> dict[str, object]:
    """Count, latencies and goodput of the finished requests selected by ``mask``."""
    ttft, e2e, out = cols["ttft"][mask], cols["e2e"][mask], cols["output_tokens"][mask]
    d = {"completed": int(mask.sum()),
         "ttft_ms": latency_stats(ttft),
         "tpot_ms": latency_stats(tpot_seconds(ttft, e2e, out)),
         "e2el_ms": latency_stats(e2e)}
    if slo.active:
        good = int(meets_slo(slo, ttft, e2e, out).sum())
        d["goodput_req_s"] = good / duration if duration > 0 else 0.0
        d["slo_attainment"] = good / max(1, int(mask.sum()))
    return d
