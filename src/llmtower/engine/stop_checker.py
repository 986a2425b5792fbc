"""Stop strings: find the first stop string in the text a request has produced so far.

Stop strings are matched on text, not tokens, so a stop string may be split across the text
of two or more steps. Each step searches only the new text plus the last
``len(longest stop) - 1`` characters before it, so a step costs O(new text), not O(text).
While a request streams, those same last characters are held back from the client: they may
be the start of a stop string that the next step completes, and a stop string must never be
half-sent.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    """A stop string found in the text, and where the text must be cut."""

    stop: str
    truncate_to: int


class StopChecker:
    """Owns one request's stop strings and whether the matched one stays in the output."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop={stop!r} contains an empty string; remove it")
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in stop), default=0)

    @property
    def holdback(self) -> int:
        """Characters at the end of the text not to stream yet: the longest proper prefix of
        a stop string that could be there."""
        return max(0, self.max_stop_len - 1)

    def check(self, text: str, num_new_chars: int) -> StopMatch | None:
        """Search the last ``num_new_chars`` characters of ``text`` for the end of a stop
        string. The match that ends first wins, as it would have if the text had come one
        character at a time; of two that end together, the one that starts first."""
        if not self.stop or num_new_chars <= 0:
            return None
        start = max(0, len(text) - num_new_chars - self.max_stop_len + 1)
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stop:
            i = text.find(s, start)
            if i != -1 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is None:
            return None
        end, begin, s = best
        return StopMatch(s, end if self.include_stop_str_in_output else begin)
