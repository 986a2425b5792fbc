"""Readers of the values people type for engine settings: sizes ('2GiB'), vLLM's swap space
(a bare number is GiB), token counts ('4k', '4K'), byte counts, and tenant weights ('a=2,b=1').
Each error says what to write instead."""
from __future__ import annotations

import argparse
import re

def parse_bytes(text: str | int | float) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 2GiB, 512MiB or a byte count")
    value, unit = float(m.group(1)), (m.group(2) or "").upper().rstrip("B")
    mult = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
            "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(value * mult)


def parse_swap_space(text: str | int | float) -> int:
    """--swap-space as vLLM reads it: a bare number is GiB ('4' -> 4 GiB); a size with a unit
    ('512MiB', '2GB') is taken as written."""
    if isinstance(text, (int, float)) or re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", text):
        return int(float(text) * 2**30)
    return parse_bytes(text)


def parse_tenant_weights(text: str | dict | None) -> dict[str, float]:
    """'a=2,b=1' (or a dict) -> {'a': 2.0, 'b': 1.0}: --policy fair's tenant weights."""
    if not text:
        return {}
    if isinstance(text, dict):
        items = list(text.items())
    else:
        items = []
        for part in text.split(","):
            name, sep, w = part.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"tenant_weights={text!r} is invalid: write tenant=weight "
                                 "pairs separated by commas, e.g. a=2,b=1")
            items.append((name.strip(), w))
    out = {}
    for name, w in items:
        try:
            out[str(name)] = float(w)
        except (TypeError, ValueError):
            raise ValueError(f"tenant_weights: the weight of {name!r} is {w!r}, not a number") from None
        if not out[str(name)] > 0:
            raise ValueError(f"tenant_weights: the weight of {name!r} must be > 0, not {w!r}")
    return out


def parse_token_count(text: str | int) -> int:
    """A token count as vLLM reads it: '4096', '4k' (4000), '4K' (4096), '1m', '1M', '25.6k'."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a token count: use e.g. 4096, 4k (4000) or 4K (4096)")
    suffix = m.group(2)
    mult = 1 if not suffix else (
        {"k": 10**3, "m": 10**6, "g": 10**9}[suffix] if suffix.islower()
        else {"K": 2**10, "M": 2**20, "G": 2**30}[suffix])
    value = float(m.group(1)) * mult
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)


def parse_byte_count(text: str | int) -> int:
    """--kv-cache-memory-bytes as vLLM reads it: '2147483648', '2G' (2 GiB), '2g' (2*10^9)."""
    try:
        return parse_token_count(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a byte count: use e.g. 2147483648, 2G (2 GiB) or 2g "
            "(2*10^9), or --kv-cache-memory 2GiB") from None
