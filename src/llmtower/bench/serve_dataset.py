"""Prompts for `llmtower bench serve`: random token prompts of chosen lengths (with an
optional shared prefix) or the lines of a JSONL file."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class BenchRequest:
    """One prompt to send: its text, its length in tokens (0 if unknown) and how many tokens
    to ask for."""

    prompt: str
    prompt_len: int
    output_len: int


def sample_random_requests(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                           range_ratio: float, prefix_len: int, seed: int) -> list[BenchRequest]:
    """Prompts of random tokens, like `vllm bench serve --dataset-name random`: input and
    output lengths uniform in [len * (1 - r), len * (1 + r)], every prompt starting with the
    same ``prefix_len`` random tokens (to exercise prefix caching)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random_range_ratio={range_ratio} is invalid: use 0 <= r < 1")
    if input_len < 1 or output_len < 1:
        raise ValueError("random_input_len and random_output_len must be >= 1")
    rng = np.random.default_rng(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = np.array([t for t in range(len(tokenizer)) if t not in special])
    in_lens = rng.integers(max(1, int(input_len * (1 - range_ratio))),
                           int(input_len * (1 + range_ratio)) + 1, size=num_prompts)
    out_lens = rng.integers(max(1, int(output_len * (1 - range_ratio))),
                            int(output_len * (1 + range_ratio)) + 1, size=num_prompts)
    prefix = rng.choice(vocab, size=prefix_len).tolist() if prefix_len else []
    requests = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = prefix + rng.choice(vocab, size=int(n_in)).tolist()
        # Decoding random ids and encoding the text again can merge or split tokens: cut the
        # re-encoded ids to the wanted length so the server sees that many.
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)[:prefix_len + int(n_in)]
        text = tokenizer.decode(ids)
        requests.append(BenchRequest(text, len(ids), int(n_out)))
    return requests


def load_jsonl_requests(path: str | Path, num_prompts: int, default_output_len: int,
                        tokenizer: Any | None) -> list[BenchRequest]:
    """The first ``num_prompts`` lines of a JSONL file, each ``{"prompt": str}`` with an
    optional ``"output_len"`` (or ``"max_tokens"``); cycled if the file is shorter."""
    path = Path(path)
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i} is not valid JSON: {e}") from e
        prompt = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{i} has no \"prompt\" string; each line must be like "
                             '{"prompt": "...", "output_len": 128}')
        out = row.get("output_len", row.get("max_tokens", default_output_len))
        rows.append((prompt, int(out)))
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    out_rows = [rows[i % len(rows)] for i in range(num_prompts)]
    return [BenchRequest(p, len(tokenizer.encode(p, add_special_tokens=False)) if tokenizer
                         else 0, o) for p, o in out_rows]
