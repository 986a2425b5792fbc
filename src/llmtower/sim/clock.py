"""Virtual time for the simulator."""
from __future__ import annotations


class VirtualClock:
    """Owns one simulated time line (seconds). Calling it returns the time, so it can be handed
    to the Scheduler as its ``clock``; only ``advance_to`` moves it, forward."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        """Jump to ``t`` if it is later (an idle replica catching up with an arrival)."""
        if t > self.now:
            self.now = t
