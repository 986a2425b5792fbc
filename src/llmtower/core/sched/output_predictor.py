"""An online predictor of a request's output length, for ``--policy sjf`` and the
``remaining`` preemption-victim rule.

Output length correlates with prompt length only loosely, but it is the one thing known at
admission. The predictor keeps, per prompt-length bucket (powers of two: 1, 2-3, 4-7, ...),
an exponential moving average of the output lengths of requests that finished on their own
(``stop`` or ``length``; aborted requests are cut short and teach nothing). A bucket with no
history borrows the global average; before any request finished it predicts ``prior``.

It never reads ``max_tokens``: in the simulator ``max_tokens`` *is* the true output length,
and reading it would turn the predictor back into the oracle it replaces.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OutputLengthPredictor:
    """Owns the per-bucket running estimates of output length (O(1) per update and query)."""

    prior: float = 128.0
    alpha: float = 0.05  # weight of one new observation in the moving average
    # bucket (prompt_len.bit_length()) -> [estimate, observations]
    buckets: dict[int, list[float]] = field(default_factory=dict)
    global_estimate: float = 0.0
    num_observed: int = 0

    def predict(self, num_prompt_tokens: int) -> float:
        b = self.buckets.get(num_prompt_tokens.bit_length())
        if b is not None:
            return b[0]
        return self.global_estimate if self.num_observed else self.prior

    def observe(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        x = float(num_output_tokens)
        key = num_prompt_tokens.bit_length()
        b = self.buckets.get(key)
        if b is None:
            self.buckets[key] = [x, 1.0]
        else:
            # A plain mean for the first observations, then a moving average (tracks drift).
            b[1] += 1.0
            b[0] += (x - b[0]) * max(self.alpha, 1.0 / b[1])
        self.num_observed += 1
        self.global_estimate += (x - self.global_estimate) * max(self.alpha, 1.0 / self.num_observed)
