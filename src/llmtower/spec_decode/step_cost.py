"""What a forward pass costs as a function of its rows, measured as the engine runs.

A step over T rows (tokens of all requests, drafts included) takes about ``fixed + per_row * T``
seconds: ``fixed`` is what a step pays whatever its size (reading every weight from memory,
Python and kernel-launch overhead), ``per_row`` the arithmetic of one more row. On a CPU at
small T the fixed part dominates (SmolLM2, one thread: about 36 ms fixed and 1.6 ms per row),
which is why a draft token is nearly free for one stream and costs about a real token's row
in a batch of eight.

``StepCostModel`` fits the two numbers by least squares over the recent steps (exponentially
decayed, so a change of load or batch mix is followed), and answers with the prior ratio until
the steps seen differ enough in size to tell the two apart.
"""
from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.98  # weight of a step after 50 more: ~0.36
PRIOR_FIXED_ROWS = 20.0  # fixed / per_row before the fit: SmolLM2 float32 on one core, ~22
MIN_SPREAD = 1.0  # weighted variance of T (rows^2) needed before the fit is trusted
MIN_RATIO, MAX_RATIO = 0.5, 200.0


@dataclass
class StepCostModel:
    """Owns the decayed sums of (rows, seconds) and the fitted ``fixed / per_row`` ratio."""

    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or not seconds > 0.0:
            return
        d = DECAY
        self.w = d * self.w + 1.0
        self.sx = d * self.sx + rows
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + rows * rows
        self.sxy = d * self.sxy + rows * seconds

    def fixed_rows(self) -> float:
        """The fixed cost of a step in units of one row's cost (``fixed / per_row``)."""
        if self.w <= 0.0:
            return PRIOR_FIXED_ROWS
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var < MIN_SPREAD:
            return PRIOR_FIXED_ROWS
        per_row = (self.sxy / self.w - mx * my) / var
        fixed = my - per_row * mx
        if per_row <= 0.0:  # rows cost nothing measurable: only the fixed part counts
            return MAX_RATIO
        return min(MAX_RATIO, max(MIN_RATIO, fixed / per_row))

    def per_row_seconds(self) -> float:
        """Seconds one more row of a step costs (the fit's slope; before the fit, the mean step
        split by the prior ratio). 0.0 before any step."""
        if self.w <= 0.0:
            return 0.0
        mx, my = self.sx / self.w, self.sy / self.w
        return my / (mx + self.fixed_rows())

    def min_acceptance(self, num_reqs: int) -> float:
        """The chance of acceptance a draft position needs to pay for itself in a step of
        ``num_reqs`` requests. It costs one row; an accepted token saves the request one step,
        that is its own row plus its share of the step's fixed cost: worth it while
        p * (per_row + fixed / num_reqs) >= per_row."""
        return 1.0 / (1.0 + self.fixed_rows() / max(1, num_reqs))
