"""Synthetic workloads: arrival processes, length distributions, priority / tenant mixes and
shared prefixes, all drawn from one seed.

Length specs (for ``--input-len`` / ``--output-len``):

- ``128`` or ``fixed:128``;
- ``uniform:32-256`` (inclusive);
- ``lognormal:MEAN,SIGMA`` (clipped to [1, 8192]);
- ``sharegpt``: a heavy tail like ShareGPT conversations: a lognormal with the means the
  vLLM paper (Kwon et al., SOSP'23, "Efficient Memory Management for LLM Serving with
  PagedAttention", Fig. 11) reports for ShareGPT, 161.31 input and 337.99 output tokens, and
  sigma 1.0 (our assumption: the paper publishes means, not shapes), clipped to [4, 2048].

Arrivals: Poisson at ``rate`` requests/s, or gamma with ``burstiness`` (shape; 1 is Poisson,
below 1 burstier), as ``vllm bench serve`` does; ``rate`` inf sends everything at t=0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llmtower.sim.workload import TraceRequest

SHAREGPT_MEAN = {"input": 161.31, "output": 337.99}
SHAREGPT_SIGMA = 1.0
SHAREGPT_CLIP = (4, 2048)


@dataclass(frozen=True)
class LengthDist:
    """Owns one token-length distribution parsed from a spec string."""

    kind: str  # fixed | uniform | lognormal
    a: float
    b: float = 0.0
    lo: int = 1
    hi: int = 8192
    spec: str = ""

    @classmethod
    def parse(cls, spec: str, role: str = "input") -> LengthDist:
        s = str(spec).strip().lower()
        try:
            if s == "sharegpt":
                return cls("lognormal", SHAREGPT_MEAN[role], SHAREGPT_SIGMA, *SHAREGPT_CLIP, spec=s)
            kind, _, arg = s.partition(":")
            if not arg:
                kind, arg = "fixed", kind
            if kind == "fixed":
                n = int(arg)
                if n < 1:
                    raise ValueError
                return cls("fixed", n, spec=s)
            if kind == "uniform":
                lo, hi = (int(x) for x in arg.split("-"))
                if not 1 <= lo <= hi:
                    raise ValueError
                return cls("uniform", lo, hi, spec=s)
            if kind == "lognormal":
                mean, sigma = (float(x) for x in arg.split(","))
                if mean < 1 or sigma < 0:
                    raise ValueError
                return cls("lognormal", mean, sigma, spec=s)
        except ValueError:
            pass
        raise ValueError(f"cannot read {role} length {spec!r}: use N, fixed:N, uniform:LO-HI, "
                         "lognormal:MEAN,SIGMA or sharegpt (N, LO, HI >= 1)")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, int(self.a), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b) + 1, size=n)
        mu = math.log(self.a) - self.b * self.b / 2  # so that the mean is self.a
        x = np.rint(rng.lognormal(mu, self.b, size=n)).astype(np.int64)
        return np.clip(x, self.lo, self.hi)


def parse_mix(spec: str | None, what: str, value_type=str) -> tuple[list, np.ndarray]:
    """'a:1,b:3' -> (values, probabilities); weights default to 1."""
    if not spec:
        return [], np.zeros(0)
    values, weights = [], []
    for part in spec.split(","):
        name, _, w = part.strip().partition(":")
        try:
            values.append(value_type(name))
            weights.append(float(w) if w else 1.0)
        except ValueError:
            raise ValueError(f"cannot read {what} {spec!r}: use VALUE:WEIGHT,VALUE:WEIGHT "
                             f"(e.g. {'0:1,1:3' if value_type is int else 'a:1,b:3'})") from None
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{what} {spec!r}: weights must be >= 0 and not all zero")
    p = np.asarray(weights) / sum(weights)
    return values, p


@dataclass
class WorkloadSpec:
    """Owns the description of a synthetic workload (everything ``generate`` needs)."""

    num_requests: int = 1000
    rate: float = math.inf  # requests per second
    burstiness: float = 1.0
    input_len: str = "uniform:32-512"
    output_len: str = "uniform:16-256"
    priority_mix: str | None = None  # e.g. "0:1,1:3"
    tenants: str | None = None  # e.g. "a:1,b:1"
    num_prefix_groups: int = 0
    prefix_len: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests={self.num_requests} must be >= 1")
        if not self.rate > 0:
            raise ValueError(f"rate={self.rate} must be > 0 requests/s (inf: all at once)")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness={self.burstiness} must be > 0 (1: Poisson)")
        if self.num_prefix_groups < 0 or self.prefix_len < 0:
            raise ValueError("num_prefix_groups and prefix_len must be >= 0")


def arrival_times(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> np.ndarray:
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def generate(spec: WorkloadSpec) -> list[TraceRequest]:
    """Draw a trace; the same spec (seed included) always gives the same trace."""
    n = spec.num_requests
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(spec.seed).spawn(6)]
    arrivals = arrival_times(streams[0], n, spec.rate, spec.burstiness)
    unique = LengthDist.parse(spec.input_len, "input").sample(streams[1], n)
    outputs = LengthDist.parse(spec.output_len, "output").sample(streams[2], n)
    prios, p = parse_mix(spec.priority_mix, "priority mix", int)
    priority = streams[3].choice(prios, size=n, p=p) if prios else np.zeros(n, dtype=np.int64)
    names, p = parse_mix(spec.tenants, "tenants")
    tenant_idx = streams[4].choice(len(names), size=n, p=p) if names else None
    groups = (streams[5].integers(0, spec.num_prefix_groups, size=n)
              if spec.num_prefix_groups else None)
    prefix = spec.prefix_len if groups is not None else 0
    out = []
    for i in range(n):
        out.append(TraceRequest(
            arrival_time=float(arrivals[i]), prompt_len=int(unique[i]) + prefix,
            output_len=int(outputs[i]), priority=int(priority[i]),
            tenant=names[tenant_idx[i]] if tenant_idx is not None else "default",
            prefix_group=f"g{groups[i]}" if groups is not None else None,
            prefix_len=prefix if groups is not None else None, request_id=str(i)))
    return out
