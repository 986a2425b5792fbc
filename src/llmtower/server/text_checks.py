"""Checks on the text of a request before anything tokenizes it: lone surrogates, and the
character length of a prompt or conversation (cheap to measure, costly to tokenize)."""
from __future__ import annotations

from typing import Any


def _bad_str(s: str) -> bool:
    if s.isascii():  # the common case, and O(1) per byte in C
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def find_lone_surrogate(value: Any) -> str | None:
    """Where in ``value`` (a JSON value) a string holds a lone surrogate: '' for the value
    itself, '[3]' or '.content' below it; None when every string is valid Unicode."""
    if isinstance(value, str):
        return "" if _bad_str(value) else None
    if isinstance(value, list):
        for i, item in enumerate(value):
            where = find_lone_surrogate(item)
            if where is not None:
                return f"[{i}]{where}"
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and _bad_str(key):
                return f" key {key.encode('utf-8', 'backslashreplace').decode()!r}"
            where = find_lone_surrogate(item)
            if where is not None:
                return f".{key}{where}"
    return None
