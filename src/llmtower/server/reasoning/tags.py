"""What the reasoning streamers share: how much of a delta's tail to hold back."""
from __future__ import annotations


def held_back(text: str, tags: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` may begin one of ``tags``."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:k]):
                best = max(best, k)
                break
    return best
