"""Reading a server's ``/metrics`` the way Prometheus would, for ``llmtower monitor``: parse
with ``prometheus_client``'s parser, then gauges as they are, counters as rates between two
scrapes, histograms as quantiles of what was observed between two scrapes (the same linear
interpolation inside a bucket as ``histogram_quantile``).

Every value can be asked for one engine (label ``engine``) or for all of them together.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

Labels = dict[str, str]


@dataclass
class Scrape:
    """One parse of ``/metrics``: every sample by its series name, and when it was taken."""

    time: float
    samples: dict[str, list[tuple[Labels, float]]] = field(default_factory=dict)

    def engines(self) -> list[str]:
        """The engine label values present, in numeric order."""
        found = {lab["engine"] for rows in self.samples.values() for lab, _ in rows
                 if "engine" in lab}
        return sorted(found, key=lambda e: (len(e), e))

    def select(self, name: str, engine: str | None = None,
               labels: Labels | None = None) -> list[tuple[Labels, float]]:
        out = []
        for lab, value in self.samples.get(name, ()):
            if engine is not None and lab.get("engine") != engine:
                continue
            if labels and any(lab.get(k) != v for k, v in labels.items()):
                continue
            out.append((lab, value))
        return out

    def values(self, name: str, engine: str | None = None,
               labels: Labels | None = None) -> list[float]:
        return [v for _, v in self.select(name, engine, labels)]

    def total(self, name: str, engine: str | None = None,
              labels: Labels | None = None) -> float | None:
        """The sum over matching series; None when there is none."""
        vals = self.values(name, engine, labels)
        return sum(vals) if vals else None

    def buckets(self, name: str, engine: str | None = None) -> dict[float, float]:
        """Cumulative histogram bucket counts by upper bound, summed over matching series."""
        out: dict[float, float] = {}
        for lab, value in self.select(f"{name}_bucket", engine):
            le = float(lab["le"])
            out[le] = out.get(le, 0.0) + value
        return out


def parse_metrics(text: str, now: float) -> Scrape:
    scrape = Scrape(now)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            scrape.samples.setdefault(s.name, []).append((dict(s.labels), s.value))
    return scrape


def rate(prev: Scrape | None, cur: Scrape, name: str, engine: str | None = None,
         labels: Labels | None = None) -> float | None:
    """Per-second increase of a counter between two scrapes (a reset counts from zero)."""
    if prev is None or cur.time <= prev.time:
        return None
    now = cur.total(name, engine, labels)
    if now is None:
        return None
    before = prev.total(name, engine, labels) or 0.0
    increase = now - before if now >= before else now
    return increase / (cur.time - prev.time)


def histogram_quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """The ``q`` quantile of cumulative bucket counts, as Prometheus's ``histogram_quantile``
    computes it: linear inside the bucket, the highest finite bound for the +Inf bucket."""
    if not cumulative:
        return None
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def interval_quantile(prev: Scrape | None, cur: Scrape, name: str, q: float,
                      engine: str | None = None) -> float | None:
    """The ``q`` quantile of what a histogram observed between two scrapes (of everything
    since the start when there is no earlier scrape); None when nothing was observed."""
    now = cur.buckets(name, engine)
    if prev is not None:
        before = prev.buckets(name, engine)
        now = {le: max(0.0, c - before.get(le, 0.0)) for le, c in now.items()}
    return histogram_quantile(q, now)
